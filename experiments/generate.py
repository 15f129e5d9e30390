"""Generate a continuation with the paged-KV engine (dense or block-sparse attention).

    python experiments/generate.py --config tiny --prompt "12+7="           # random weights
    python experiments/generate.py --config smollm2_135m --model-path SmolLM2.gguf \
        --prompt "What is the capital of France?" --max-new-tokens 64
    python experiments/generate.py ... --sparse-budget 8          # block-sparse decode
    python experiments/generate.py ... --schedule qwen3-1.7b-0.86 # a sparsity schedule
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="tiny", help="model preset (architecture)")
  ap.add_argument("--model-path", default=None, help="HF safetensors dir or .gguf file")
  ap.add_argument("--prompt", action="append", required=True,
                  help="prompt text (repeat for a batch)")
  ap.add_argument("--max-new-tokens", type=int, default=32)
  ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--top-k", type=int, default=0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--no-chat-template", action="store_true",
                  help="feed the raw prompt even if the tokenizer has a chat template")
  ap.add_argument("--sparse-budget", type=int, default=None,
                  help="block-sparse decode with this many top-k pages (+ reserved pages)")
  ap.add_argument("--schedule", default=None,
                  help="sparsity schedule: preset name, JSON file, constant:K or dense")
  ap.add_argument("--landmark", default="mean", choices=["mean", "quest"])
  ap.add_argument("--backend", default="auto", choices=["auto", "xla", "pallas",
                                                        "pallas_interpret"])
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--max-seq-len", type=int, default=None)
  args = ap.parse_args(argv)

  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.decoder import init_model
  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
  from sparrow_jax.engine.sampling import SamplingParams
  from sparrow_jax.rl.tokenizers import ByteTokenizer

  try:
    if args.model_path:
      from sparrow_jax.models import load_pretrained, load_tokenizer
      model = load_pretrained(args.model_path)
      tok = load_tokenizer(args.model_path)
    else:
      cfg = get_config(args.config)
      if cfg.name != "tiny":
        raise ValueError(f"--config {args.config} needs --model-path (only 'tiny' runs with "
                         "random weights)")
      tok = ByteTokenizer()
      model = init_model(cfg.replace(vocab_size=tok.vocab_size, bos_token_id=1,
                                     eos_token_ids=(2,), pad_token_id=0), seed=args.seed)
    if args.sparse_budget is not None and args.schedule is not None:
      raise ValueError("give --sparse-budget or --schedule, not both")
    attention, schedule = attn_lib.Dense(), None
    if args.schedule is not None or args.sparse_budget is not None:
      from sparrow_jax.schedule import parse_schedule
      from sparrow_jax.schedule.schedule import attention_spec
      import dataclasses
      spec = args.schedule or f"constant:{args.sparse_budget}"
      schedule = parse_schedule(spec)
      if not schedule.is_dense:
        schedule = dataclasses.replace(schedule, landmark=args.landmark)
        if spec.startswith("constant:"):
          schedule = dataclasses.replace(schedule, page_size=args.page_size)
      attention = attention_spec(schedule, backend=args.backend)
      schedule = None if schedule.is_dense else schedule
    reqs = []
    for i, text in enumerate(args.prompt):
      if isinstance(tok, ByteTokenizer):
        ids = tok.encode(text)
      elif tok.chat_template and not args.no_chat_template:
        chat = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)
        ids = list(tok(chat, add_special_tokens=False)["input_ids"])
      else:
        ids = tok(text)["input_ids"]
      reqs.append(Request(ids, SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                              top_k=args.top_k, seed=args.seed + i,
                                              max_new_tokens=args.max_new_tokens), i))
    longest = max(len(r.prompt_ids) for r in reqs)
    max_len = args.max_seq_len or min(model.cfg.max_position_embeddings,
                                       longest + args.max_new_tokens + 1)
    page = schedule.page_size if schedule is not None else args.page_size
    engine = GenerationEngine(model, EngineConfig(num_slots=len(reqs), max_seq_len=max_len,
                                                  page_size=page),
                              attention=attention, schedule=schedule)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    dt = time.perf_counter() - t0
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for r, o in zip(reqs, outs):
    print(f"--- prompt {r.request_id} ({len(r.prompt_ids)} tokens), finish={o.finish_reason}")
    print(tok.decode(o.token_ids, skip_special_tokens=True))
  n = sum(len(o.token_ids) for o in outs)
  print(f"[{n} tokens in {dt:.2f}s incl. compilation; {engine.num_compilations} compilations]",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
