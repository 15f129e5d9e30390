"""One-shot TPU suite, the GPU suite's twin: kernel checks, bandwidths, dense baseline, engine.

    python benchmarks/tpu_suite.py --out tpu_suite.json              # one TPU chip
    python benchmarks/tpu_suite.py --sections a,c --out part.json    # some sections only
    python benchmarks/tpu_suite.py --smoke --out /tmp/smoke.json     # CPU, TPU interpret mode

Ready for a TPU this project has not had yet. Sections (same letters and JSON as
`gpu_suite.py`, whose driver, time guard and timing this reuses; backend `pallas_tpu`):
  a kernels_vs_reference  the Mosaic sparse kernel (`tpu_decode.sparse_decode_tpu`), the dense
                          decode (jax's `ops.tpu.paged_attention` on the bf16 cache) and the
                          XLA path against the float32 references; fails the run on a mismatch.
  b copy_bandwidth        HBM bandwidth of an elementwise pass over a large buffer.
  c sparse_bandwidth      the sparse kernel at batch 64, 32K context, Qwen3-1.7B attention,
                          budgets 64-512 pages: HBM bytes of the selected K/V pages / kernel
                          time and as % of (b); page scoring with float32 and bf16 landmarks,
                          top-k and the whole step.
  d dense_baseline        the dense decode at the same shape for a few `pages_per_block`, and
                          the XLA path, in ms and GB/s of the sequences' own K/V pages.
  e engine_decode         engine decode dense vs the `qwen3-1.7b-0.86` schedule, random-init
                          Qwen3-1.7B (bf16), batch 4 (its 32K contexts need 15 GB of HBM beside
                          3.4 GB of weights: a v5p or v6e chip), at 8K/16K/32K tokens held.
`--smoke` runs every section at tiny shapes on CPU with the kernels in TPU interpret mode (the
CI check that the suite works; minutes, the interpreter is slow). The full run needs a TPU;
nothing here has been timed on one.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_suite as gs  # noqa: E402  (its import puts the repository on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sparrow_jax.pallas_kernels import dispatch  # noqa: E402
from sparrow_jax.pallas_kernels.tpu_decode import TpuDecodeConfig  # noqa: E402

FULL = gs.Sizes(
    batch=64, heads=16, kv_heads=8, head_dim=128, page_size=16, context=32768,
    budgets=(64, 128, 256, 512),
    check_shapes=((8, 16, 8, 128, 8192), (4, 32, 8, 128, 4096)),
    check_budget=64, copy_mib=4096, repeats=7, inner=5,
    sparse_config=TpuDecodeConfig(),
    dense_configs=(TpuDecodeConfig(), TpuDecodeConfig(pages_per_block=4),
                   TpuDecodeConfig(pages_per_block=16)),
    jax_paged={})

SMOKE = gs.Sizes(  # every code path once, at small shapes
    batch=2, heads=16, kv_heads=2, head_dim=16, page_size=16, context=128, budgets=(1, 2),
    check_shapes=((2, 16, 2, 16, 128),), check_budget=2, copy_mib=4, repeats=2, inner=1,
    sparse_config=TpuDecodeConfig(pages_per_block=2),
    dense_configs=(TpuDecodeConfig(pages_per_block=2),), jax_paged={})

FULL_ENGINE = dict(model="qwen3_1p7b", overrides={}, batch=4, chunk=8,
                   contexts=(8192, 16384, 32768))
SMOKE_ENGINE = dict(model="tiny", overrides=dict(num_layers=3, head_dim=16), batch=2, chunk=2,
                    contexts=(256,))


def dense_baseline(run: gs.Run) -> dict:
  """The TPU dense decode (jax's paged_attention) per launch config, and the XLA path."""
  z = run.sizes
  case = gs.bench_case(run)
  lengths = case[4]
  copy = gs.copy_gbps(run)
  own_pages = z.kv_heads * int(jnp.sum((lengths + z.page_size - 1) // z.page_size))
  nbytes = gs.page_bytes(run, own_pages)
  rows, outs = [], {}

  def record(impl, fn, config=None):
    if not run.has_time(impl if config is None else f"{impl} {config}"):
      return
    ms = run.time_ms(fn, *case)
    outs.setdefault(impl, fn(*case))
    rows.append(dict(impl=impl, config=config, ms=ms, gbps=nbytes / ms / 1e6,
                     pct_of_copy=100 * nbytes / ms / 1e6 / copy))

  for config in z.dense_configs:
    record("dense_kernel", jax.jit(functools.partial(
        dispatch.dense_decode_attention, backend=run.backend, config=config)),
        dict(pages_per_block=config.pages_per_block))
  record("dense_xla", jax.jit(functools.partial(dispatch.dense_decode_attention,
                                                backend="xla")))
  agreement = {impl: gs._rel_err(out, outs["dense_xla"]) for impl, out in outs.items()
               if "dense_xla" in outs and impl != "dense_xla"}
  return dict(shape=gs._bench_shape(run), own_kv_bytes=nbytes, copy_gbps=copy, rows=rows,
              rel_diff_vs_xla=agreement)


SECTIONS = {
    "a": gs.Section("a", "kernels_vs_reference", 120, gs.kernels_vs_reference),
    "b": gs.Section("b", "copy_bandwidth", 30, gs.copy_bandwidth),
    "c": gs.Section("c", "sparse_bandwidth", 150, gs.sparse_bandwidth),
    "d": gs.Section("d", "dense_baseline", 100, dense_baseline),
    "e": gs.Section("e", "engine_decode", 200, gs.engine_decode),
}


def tpu_suite() -> gs.Suite:
  return gs.Suite(name="tpu_suite", platform="tpu", sections=SECTIONS, full=FULL,
                  smoke=SMOKE, full_engine=FULL_ENGINE, smoke_engine=SMOKE_ENGINE,
                  backend=dispatch.Backend.PALLAS_TPU,
                  smoke_backend=dispatch.Backend.PALLAS_TPU_INTERPRET, doc=__doc__)


def main(argv=None) -> int:
  return gs.main(argv, suite=tpu_suite())


if __name__ == "__main__":
  sys.exit(main())
