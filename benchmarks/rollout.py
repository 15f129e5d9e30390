"""Decode throughput of the generation engine: tokens/s at several contexts and batch sizes,
dense attention against block-sparse attention, measured side by side in one run.

    python benchmarks/rollout.py                         # SmolLM2-135M shape, 1K/4K/8K, batch 1/4
    python benchmarks/rollout.py --model-path SmolLM2-135M-Instruct.Q4_1.gguf --budget 16
    python benchmarks/rollout.py --config tiny --contexts 256,512 --batches 1,2 --quick

The context is filled once per length: one prompt is prefilled, and every slot's page table
points at the same prompt pages (read-only prefix sharing; decode writes start on fresh pages
because contexts are page multiples). Then `--steps` decode steps are timed (medians over
`--repeats` jitted chunks after a warm-up chunk). Weights are random unless --model-path is
given: decode speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np


def _setup(model, attention, schedule, context: int, batch: int, steps: int, repeats: int,
           page_size: int = 16):
  """An engine whose `batch` slots all hold the same `context`-token prompt (shared pages)."""
  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine
  from sparrow_jax.models.kv_cache import pages_for

  extra = steps * (repeats + 1)
  max_len = context + extra + page_size
  prompt_pages = pages_for(context, page_size)
  gen_pages = pages_for(extra + page_size, page_size)
  num_pages = 1 + prompt_pages + batch * gen_pages
  cfg = EngineConfig(num_slots=batch, max_seq_len=max_len, page_size=page_size,
                     num_pages=num_pages, decode_chunk=steps)
  eng = GenerationEngine(model, cfg, attention=attention, schedule=schedule)
  rng = np.random.default_rng(0)
  prompt = rng.integers(3, model.cfg.vocab_size, context).astype(np.int32)
  rows = np.zeros((batch, cfg.max_pages_per_seq), np.int32)
  shared = np.arange(1, 1 + prompt_pages)
  for b in range(batch):
    own = 1 + prompt_pages + b * gen_pages + np.arange(gen_pages)
    rows[b, :prompt_pages + gen_pages] = np.concatenate([shared, own])
  # Prefill the prompt once into slot 0 (its pages are the shared ones).
  toks = np.zeros((1, prompt_pages * page_size), np.int32)
  toks[0, :context] = prompt
  one = (jnp.zeros((1,), jnp.int32), jnp.zeros((1,)), jnp.ones((1,)), jnp.zeros((1,), jnp.int32))
  t0 = time.perf_counter()
  eng.cache, tok, _, _ = eng._prefill_fn(eng.state, eng.cache, jnp.asarray(toks),
                                         jnp.asarray([context], jnp.int32),
                                         jnp.zeros((1,), jnp.int32), jnp.asarray(rows[:1]),
                                         *one, None)
  jax.block_until_ready(tok)
  prefill_s = time.perf_counter() - t0
  eng.cache = eng.cache.replace(page_table=jnp.asarray(rows),
                                lengths=jnp.full((batch,), context, jnp.int32))
  table = (jnp.asarray(eng.schedule.budgets, jnp.int32) if eng.schedule is not None
           else jnp.zeros((1,), jnp.int32))
  params = (jnp.arange(batch, dtype=jnp.int32), jnp.zeros((batch,)), jnp.ones((batch,)),
            jnp.zeros((batch,), jnp.int32))
  state = {"cur": jnp.full((batch,), int(tok[0]), jnp.int32)}

  def chunk():
    eng.cache, outs = eng._decode_fn(eng.state, eng.cache, state["cur"],
                                     jnp.ones((batch,), bool), *params, table, None)
    jax.block_until_ready(outs[0])
    state["cur"] = outs[0][-1]

  return chunk, prefill_s


def bench_pair(model, sparse, sched, context: int, batch: int, steps: int, repeats: int):
  """Dense and sparse engines decoding the same context, timed in alternation (A B A B ...)
  so that load on a shared machine hits both alike; medians of `repeats` chunks each."""
  runs = {"dense": _setup(model, attn_lib_dense(), None, context, batch, steps, repeats),
          "sparse": _setup(model, sparse, sched, context, batch, steps, repeats)}
  times = {k: [] for k in runs}
  for r in range(repeats + 1):
    for name, (chunk, _) in runs.items():
      t0 = time.perf_counter()
      chunk()
      if r:  # the first chunk includes compilation
        times[name].append(time.perf_counter() - t0)
  out = {}
  for name, ts in times.items():
    med = statistics.median(ts)
    out[name] = {"step_ms": 1e3 * med / steps, "tok_s": batch * steps / med,
                 "prefill_s": runs[name][1]}
  return out


def attn_lib_dense():
  from sparrow_jax.models import attention as attn_lib
  return attn_lib.Dense()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="smollm2_135m")
  ap.add_argument("--model-path", default=None)
  ap.add_argument("--contexts", default="1024,4096,8064")
  ap.add_argument("--batches", default="1,4")
  ap.add_argument("--budget", type=int, default=16, help="sparse top-k pages (constant)")
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
  args = ap.parse_args(argv)
  if args.quick:
    args.steps, args.repeats = 8, 2

  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.decoder import init_model
  from sparrow_jax.schedule import constant

  if args.model_path:
    from sparrow_jax.models import load_pretrained
    model = load_pretrained(args.model_path)
  else:
    model = init_model(get_config(args.config))
  sched = constant(args.budget)
  sparse = attn_lib.BlockSparse(max_budget=args.budget, dense_layers=sched.dense_layers)
  contexts = [int(x) for x in args.contexts.split(",")]
  batches = [int(x) for x in args.batches.split(",")]
  print(f"# {time.strftime('%Y-%m-%d')}  jax {jax.__version__}  backend "
        f"{jax.default_backend()}  {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} cpus)  model {model.cfg.name}  sparse budget {args.budget} pages "
        f"+ 3 reserved, layers {sched.dense_layers} dense")
  print("| context | batch | dense tok/s | sparse tok/s | sparse/dense speed | dense ms/step "
        "| sparse ms/step |")
  print("|---|---|---|---|---|---|---|")
  for ctx in contexts:
    for b in batches:
      res = bench_pair(model, sparse, sched, ctx, b, args.steps, args.repeats)
      d, s = res["dense"], res["sparse"]
      print(f"| {ctx} | {b} | {d['tok_s']:.1f} | {s['tok_s']:.1f} | "
            f"{s['tok_s'] / d['tok_s']:.2f}x | {d['step_ms']:.1f} | {s['step_ms']:.1f} |",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
