"""Training-side attention, the flash paths against the previous full-key chunks, side by side.

    python benchmarks/train_attention.py                       # T = 2K, 4K, 8K, SmolLM2 heads
    python benchmarks/train_attention.py --lengths 2048 --heads 16 --kv-heads 8 --head-dim 128

One layer's whole-sequence attention as the recompute, the update, DistillSparse and prefill
run it, on random q/k/v (speed does not depend on their values; which pages are selected
does not change how many):

* dense causal: `teacher_forced.dense_attention_causal` (flash: query chunks over the key
  blocks up to each chunk, online softmax, custom VJP) against
  `dense_attention_causal_reference` (today's path until this change: every query chunk
  attends to all T keys with the future masked, float32 upcasts, chunks rematerialised);
* teacher-forced sparse: `sparse_attention_teacher_forced` (selection per chunk, then flash
  attention over the selected pages, blocks nobody selected skipped) against
  `sparse_attention_teacher_forced_reference` (the selection as a [C, T] key mask over all
  keys), with the SmolLM2 preset's `constant:4` budget (4 top-k pages + 1 bos + 2 recent
  pages of 16 tokens) and mean landmarks;

each as a forward and as forward + backward (gradient of a random projection of the output
with respect to q, k and v). Both sides of a pair are compiled first (compile seconds printed
apart), then called in alternation (A B A B ...) so that load hits both alike; medians of
`--repeats`. Issue 16 asks the dense flash path for at most 0.6x the time of the full-key
chunks.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _programs(args, t, rng):
  from sparrow_jax.pallas_kernels import teacher_forced as tf

  b, h, kvh, d = args.batch, args.heads, args.kv_heads, args.head_dim
  dt = jnp.dtype(args.dtype)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dt)
  q, k, v = mk(b, t, h, d), mk(b, t, kvh, d), mk(b, t, kvh, d)
  w = mk(b, t, h, d)
  budget = jnp.full((b, t), args.budget, jnp.int32)
  sparse_kw = dict(kind="mean", max_budget=args.budget, page_size=args.page_size,
                   reserved_bos=1, reserved_recent=2)
  fns = {
      "dense": (lambda q, k, v: tf.dense_attention_causal(q, k, v, query_chunk=args.chunk),
                lambda q, k, v: tf.dense_attention_causal_reference(
                    q, k, v, query_chunk=args.ref_chunk)),
      "sparse": (lambda q, k, v: tf.sparse_attention_teacher_forced(
                     q, k, v, budget, query_chunk=args.chunk, **sparse_kw),
                 lambda q, k, v: tf.sparse_attention_teacher_forced_reference(
                     q, k, v, budget, query_chunk=args.ref_chunk, **sparse_kw)),
  }
  out = {}
  for name, (new, old) in fns.items():
    for mode in ("fwd", "fwd+bwd"):
      pair = []
      for f in (new, old):
        if mode == "fwd":
          pair.append(jax.jit(f))
        else:
          loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) * w)
          pair.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2))))
      out[(name, mode)] = pair
  return out, (q, k, v)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--lengths", default="2048,4096,8192")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
  ap.add_argument("--kv-heads", type=int, default=3)
  ap.add_argument("--head-dim", type=int, default=64)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--chunk", type=int, default=128, help="flash query chunk = key block")
  ap.add_argument("--ref-chunk", type=int, default=256, help="reference query chunk (today's)")
  ap.add_argument("--budget", type=int, default=4, help="sparse top-k pages (constant)")
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--parts", default="dense,sparse")
  args = ap.parse_args(argv)
  parts = args.parts.split(",")
  print(f"# {time.strftime('%Y-%m-%d %H:%M')}  jax {jax.__version__}  "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)  load "
        f"{os.getloadavg()[0]:.1f}  batch {args.batch}, {args.heads} q / {args.kv_heads} kv "
        f"heads x {args.head_dim}, {args.dtype}; flash chunk {args.chunk}, reference chunk "
        f"{args.ref_chunk}; sparse constant:{args.budget} + 3 reserved pages of "
        f"{args.page_size}; median of {args.repeats}\n")
  print("| T | attention | pass | flash s | full-key s | flash / full-key | compile s "
        "(flash, full-key) |")
  print("|---|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for t in [int(x) for x in args.lengths.split(",")]:
    progs, qkv = _programs(args, t, rng)
    for (name, mode), pair in progs.items():
      if name not in parts:
        continue
      compiled, comp = [], []
      for f in pair:
        t0 = time.perf_counter()
        compiled.append(f.lower(*qkv).compile())
        comp.append(time.perf_counter() - t0)
      times = [[], []]
      for _ in range(args.repeats):
        for i, f in enumerate(compiled):
          t0 = time.perf_counter()
          jax.block_until_ready(f(*qkv))
          times[i].append(time.perf_counter() - t0)
      new, old = (statistics.median(x) for x in times)
      print(f"| {t} | {name} | {mode} | {new:.3f} | {old:.3f} | {new / old:.2f}x | "
            f"{comp[0]:.1f}, {comp[1]:.1f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
