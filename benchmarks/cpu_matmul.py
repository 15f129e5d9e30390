"""How fast this machine's XLA (and torch) read a model's weights at each decode batch size.

    python benchmarks/cpu_matmul.py                       # SmolLM2-135M's MLP shape
    python benchmarks/cpu_matmul.py --config qwen3_0p6b --rows 1,4,16

A decode step multiplies every weight matrix by one row per running sequence: at batch M it
is an [M, hidden] x [hidden, mlp] product per matrix, and for small M it should cost what
reading the weights costs. This script times exactly that, XLA's `x @ w` over `--mats`
distinct weight matrices of the preset's MLP shape (together far larger than the caches, so
every call streams them from memory), for every M of `--rows`, in float32 and bfloat16
(float32 accumulation), in int8 (weight-only: `x @ w.astype(float32) * scale`; and int8
activations too, int32 accumulation), and the same products in torch (`F.linear`, the layout transformers
uses) when torch is installed, and through the C++ packed matmul of `sparrow_jax.cpu_kernels`
(float32 and bfloat16 panels, what `cpu_decode_weights` runs). Beside them: the machine's streaming read rate (a sum over 256
MB, as `step_profile.py` measures it) and what the rates mean for one decode step of the
preset (its parameter bytes / the rate).

It exists because the rollout phase of a CPU step runs far below the bandwidth the step
profile reports (issue 22): on the 2-core AVX-512 VM of 2026-12-03, XLA read float32
weights at 25 GB/s for M = 1 but 11-14 GB/s for M = 2-8 and 9 GB/s for M = 16 (the study
preset's 16 rollouts), bfloat16 weights at 1.2 GB/s for M = 1 and 7-11 GB/s for M = 2-16;
this is the library's matmul, not the engine's code (BENCHMARKS.md). Medians of `--repeats`
calls after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_profile import _median_time, machine_rates, model_terms  # noqa: E402


def xla_rate(mats, rows: int, dtype, repeats: int) -> float:
  """Seconds for `x @ w` over every matrix of `mats` with x [rows, hidden] (one program)."""
  x = jnp.ones((rows, mats[0].shape[0]), dtype)
  f = jax.jit(lambda x, ws: sum(jnp.dot(x, w, preferred_element_type=jnp.float32)
                                for w in ws))
  return _median_time(f, x, mats, repeats=repeats)


def xla_int8_rate(mats, scales, rows: int, repeats: int, *, int8_activations: bool) -> float:
  """Seconds for the same products with int8 weights and per-column float32 scales.

  `int8_activations=False`: weight-only quantization, `x @ w.astype(float32) * scale` (what a
  weight-only int8 decode would compile to). True: the rows quantized too (one scale per row),
  an int8 x int8 product accumulated in int32, then both scales applied.
  """
  x = jnp.ones((rows, mats[0].shape[0]), jnp.float32)

  def one(x, w, s):
    if not int8_activations:
      return jnp.dot(x, w.astype(jnp.float32)) * s
    xs = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-12) / 127.0
    xq = jnp.round(x / xs).astype(jnp.int8)
    acc = jax.lax.dot(xq, w, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xs * s

  f = jax.jit(lambda x, ws, ss: sum(one(x, w, s) for w, s in zip(ws, ss)))
  return _median_time(f, x, mats, scales, repeats=repeats)


def packed_rate(mats, rows: int, repeats: int) -> float:
  """Seconds for the same products through the C++ packed matmul (`sparrow_jax.cpu_kernels`,
  the engine's `cpu_decode_weights`): `mats` already packed as [P, K, 64] panels."""
  from sparrow_jax import cpu_kernels as ck
  n = mats[0].shape[0] * mats[0].shape[2]
  x = jnp.ones((rows, mats[0].shape[1]), jnp.float32)
  f = jax.jit(lambda x, ws: sum(ck.packed_matmul(x, w, n) for w in ws))
  return _median_time(f, x, mats, repeats=repeats)


def torch_rate(mats, rows: int, repeats: int) -> float:
  import torch
  x = torch.ones((rows, mats[0].shape[1]), dtype=mats[0].dtype)

  def go():
    with torch.no_grad():
      for w in mats:
        torch.nn.functional.linear(x, w)

  return _median_time(go, repeats=repeats)  # (go returns None: nothing to block on)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="smollm2_135m", help="model preset (its MLP shape)")
  ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="batch sizes M")
  ap.add_argument("--mats", type=int, default=60,
                  help="distinct weight matrices per call (60 x SmolLM2's 3.5 MB = 212 MB)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--no-torch", action="store_true", help="XLA only")
  args = ap.parse_args(argv)
  try:
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
  except ValueError:
    print(f"error: --rows {args.rows!r}: expected comma-separated integers", file=sys.stderr)
    return 2
  if not rows or min(rows) < 1 or args.mats < 1 or args.repeats < 1:
    print("error: --rows, --mats and --repeats must be positive", file=sys.stderr)
    return 2
  from sparrow_jax.models.config import get_config
  mc = get_config(args.config)
  d, f = mc.hidden_size, mc.intermediate_size
  terms = model_terms(mc)
  params = terms["layers"] * terms["layer_params"] + terms["lm_params"]
  stream = machine_rates(d, f)["bytes"]
  print(f"# {time.strftime('%Y-%m-%d %H:%M')}  jax {jax.__version__}  "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)  "
        f"load {os.getloadavg()[0]:.1f}")
  print(f"# {args.config}: weight matrices [{d}, {f}] x {args.mats}; streaming read "
        f"{stream / 1e9:.1f} GB/s; {params / 1e6:.0f}M parameters")

  rng = np.random.default_rng(0)
  cols = []  # (name, bytes per element, seconds per M)
  for name, dt in (("XLA float32", jnp.float32), ("XLA bfloat16", jnp.bfloat16)):
    mats = [jnp.asarray(rng.standard_normal((d, f)), dt) for _ in range(args.mats)]
    cols.append((name, jnp.dtype(dt).itemsize,
                 {m: xla_rate(mats, m, dt, args.repeats) for m in rows}))
    del mats
  # int8 weights (per-column scales): a quarter of float32's bytes, if XLA streamed them
  mats, scales = [], []
  for _ in range(args.mats):
    w = rng.standard_normal((d, f)).astype(np.float32)
    sc = np.abs(w).max(axis=0) / 127.0
    mats.append(jnp.asarray(np.round(w / sc).astype(np.int8)))
    scales.append(jnp.asarray(sc, jnp.float32))
  for name, act in (("XLA int8 weights", False), ("XLA int8 x int8", True)):
    cols.append((name, 1, {m: xla_int8_rate(mats, scales, m, args.repeats,
                                            int8_activations=act) for m in rows}))
  del mats, scales
  from sparrow_jax import cpu_kernels as ck
  if ck.available():
    for name, dt in (("C++ packed float32", jnp.float32), ("C++ packed bfloat16", jnp.bfloat16)):
      mats = [ck.pack_weight(jnp.asarray(rng.standard_normal((d, f)), jnp.float32), dt)
              for _ in range(args.mats)]
      cols.append((name, jnp.dtype(dt).itemsize,
                   {m: packed_rate(mats, m, args.repeats) for m in rows}))
      del mats
  else:
    print(f"note: C++ CPU kernels unavailable ({ck.unavailable_reason()})", file=sys.stderr)
  if not args.no_torch:
    try:
      import torch
    except ImportError:
      torch = None
    if torch is not None:
      torch.set_num_threads(os.cpu_count())
      for name, dt in (("torch float32", torch.float32), ("torch bfloat16", torch.bfloat16)):
        mats = [torch.randn((f, d), dtype=dt) for _ in range(args.mats)]
        cols.append((name, mats[0].element_size(),
                     {m: torch_rate(mats, m, args.repeats) for m in rows}))
        del mats

  print("\nWeight bytes read per second (GB/s) and GFLOP/s, by batch M; "
        "last columns: one decode step's weight read at that rate (ms)\n")
  print("| M | " + " | ".join(f"{n} GB/s | GFLOP/s" for n, _, _ in cols) + " | " +
        " | ".join(f"{n} step ms" for n, _, _ in cols) + " |")
  print("|---|" + "---|---|" * len(cols) + "---|" * len(cols))
  nbytes_el = args.mats * d * f
  for m in rows:
    cells, step = [], []
    for _, size, ts in cols:
      s = ts[m]
      cells.append(f"{nbytes_el * size / s / 1e9:.1f} | {2 * m * nbytes_el / s / 1e9:.0f}")
      step.append(f"{params * size / (nbytes_el * size / s) * 1e3:.1f}")
    print(f"| {m} | " + " | ".join(cells) + " | " + " | ".join(step) + " |", flush=True)
  print(f"\nAt the streaming rate a step's weight read takes {params * 4 / stream * 1e3:.1f} ms "
        f"in float32, {params * 2 / stream * 1e3:.1f} ms in bfloat16, "
        f"{params / stream * 1e3:.1f} ms in int8.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
