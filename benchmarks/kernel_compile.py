"""Compile every GPU decode-kernel configuration the project can select for an H200 (sm_90).

    python benchmarks/kernel_compile.py --target sm_90            # table
    python benchmarks/kernel_compile.py --target sm_90 --json     # ... + JSON list, last line
    python benchmarks/kernel_compile.py --target sm_90 --only defaults --models qwen3_1p7b
    python benchmarks/kernel_compile.py --splits                  # split-K launch table
    python benchmarks/kernel_compile.py --ptx DIR                 # dense vs sparse PTX

No GPU is needed: each kernel is exported for CUDA (the Pallas Triton lowering runs on the
CPU), its Triton IR taken from the `__gpu$xla.gpu.triton` custom call and compiled with PyPI
`triton` for `GPUTarget("cuda", 90, 32)`; `ptxas -v` (bundled in the wheel) gives registers and
spills, Triton's allocation the shared memory (`sparrow_jax.pallas_kernels.gpu_compile`).

What is compiled (`targets`):
  defaults  the dense (`PagedDecodeConfig()`) and sparse (`SparseDecodeConfig()`) kernels at the
            attention shape of every model preset (head dim, GQA group) and of the GPU suite's
            check shapes, page size 16, bf16 and float32 caches: what `Dense()` / `BlockSparse`
            run with `backend="pallas"`; and the page-score kernel (`page_scores.py`) per head
            dim, mean and quest ("scores_quest") landmarks, bf16 and float32.
  sweep     the GPU suite's dense launch sweep (`gpu_suite.FULL.dense_configs`) at its bench
            shape (16 q / 8 kv heads x 128, bf16, page 16).
A row fails ("SPILL", "SMEM") on a register spill or on more than 227 KiB of shared memory per
block; a config the project refuses at construction is listed as "REFUSED" with the reason.
Exit status: 0, or 1 when a default configuration fails (sweep rows are reported, not gating),
2 for bad arguments or a jaxlib that no longer emits the Triton IR on a CPU (> 0.10.2; the
message says so). Caveat: PyPI triton is not XLA's pinned Triton: this screens limits and
unsupported ops; it does not reproduce XLA's build exactly.

`--ptx DIR` compiles the dense and sparse defaults at Qwen3-1.7B's decode shape (16 q / 8 kv
heads x 128, bf16, page 16, a 4,096-page pool, 2,048-page tables, and for the sparse kernel the
selection slots of the published `qwen3-1.7b-0.86` schedule's largest budget) and writes each
kernel's TTGIR and PTX into DIR, with a table of the memory and tensor-core instructions of
each kernel's K/V block loop by width (`gpu_compile.ptx_memory_ops`; docs/gpu/
sparse_kernel_ptx.md reads them).

`--splits` prints, per GPU training preset (64 slots per device, max length 34,816 tokens, its
schedule's largest budget), the programs each kernel launches and the float32 partial bytes it
writes with the old fixed split-K (k_splits = 8, 16 padded rows) and with splits sized to the
work (`split_k.num_splits`, next_pow2(G) rows), at the full slot count and at a few tails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sparrow_jax.models.config import PRESETS as MODEL_PRESETS  # noqa: E402
from sparrow_jax.pallas_kernels import gpu_compile, page_scores, split_k  # noqa: E402
from sparrow_jax.pallas_kernels.paged_decode import PagedDecodeConfig, paged_decode  # noqa: E402
from sparrow_jax.pallas_kernels.sparse_decode import SparseDecodeConfig, sparse_decode  # noqa: E402

PAGE_SIZE = 16
DTYPES = ("bfloat16", "float32")
# The GPU suite's check shapes (gpu_suite.FULL.check_shapes): (heads, kv_heads, head_dim).
SUITE_SHAPES = {"suite_check_g4": (32, 8, 128), "suite_check_g8": (16, 2, 64)}
SUITE_BENCH = (16, 8, 128)  # sections c/d: Qwen3-1.7B attention


@dataclasses.dataclass(frozen=True)
class Target:
  kernel: str  # "dense" | "sparse" | "scores" / "scores_quest" (the page-score kernel)
  config: object  # PagedDecodeConfig | SparseDecodeConfig | None (scores)
  dtype: str  # the cache dtype; for "scores" the landmark dtype
  heads: int
  kv_heads: int
  head_dim: int
  used_by: str  # which preset / suite part selects it
  gating: bool  # a failure fails the run (defaults) or is only reported (sweep)
  page_size: int = PAGE_SIZE

  @property
  def group(self) -> int:
    return self.heads // self.kv_heads


def _triton_head_dim(mc) -> bool:
  """The model's head dim is one the Triton kernels accept (a power of two >= MIN_DOT)."""
  return split_k.is_pow2(mc.head_dim) and mc.head_dim >= split_k.MIN_DOT


def _shapes(models=None) -> dict[str, tuple[int, int, int]]:
  """(heads, kv_heads, head_dim) of the model presets the Triton kernels accept, and of the
  GPU suite's check shapes."""
  out = {}
  for name, mc in MODEL_PRESETS.items():
    if models and name not in models:
      continue
    if _triton_head_dim(mc):
      out[name] = (mc.num_heads, mc.num_kv_heads, mc.head_dim)
  if not models:
    out.update(SUITE_SHAPES)
  return out


def _small_page_shapes(models=None) -> dict[str, tuple[int, int, int, int]]:
  """(heads, kv_heads, head_dim, page_size) of the training presets whose pages are not
  PAGE_SIZE tokens (their kernels take a page-size-aware default: `split_k.default_config`)."""
  from sparrow_jax.run.config import PRESETS as TRAIN_PRESETS
  out = {}
  for name, tc in TRAIN_PRESETS.items():
    mc = MODEL_PRESETS[tc.model]
    if tc.page_size == PAGE_SIZE or (models and tc.model not in models and name not in models):
      continue
    if _triton_head_dim(mc):
      out[f"{name} (pages of {tc.page_size})"] = (mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                                  tc.page_size)
  return out


def _suite_dense_configs():
  """The GPU suite's dense launch sweep, read from the suite itself (one list to keep)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_suite.py")
  spec = importlib.util.spec_from_file_location("gpu_suite_configs", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  try:
    spec.loader.exec_module(module)
  finally:
    del sys.modules[spec.name]
  return module.FULL.dense_configs, module.FULL.sparse_config


def targets(only: str = "all", models=None) -> list[Target]:
  """Every (kernel, config, dtype, shape) to compile; `only` = defaults | sweep | all."""
  out = []
  if only in ("defaults", "all"):
    # Kernels differ only in head dim and partial rows (the dot pads every group to 16): one
    # compile per (head dim, partial rows), labelled with every preset that selects it.
    by_kernel: dict = {}
    for name, (h, k, d) in _shapes(models).items():
      by_kernel.setdefault((d, split_k.partial_rows(h // k)), []).append((name, h, k))
    for (d, _), users in by_kernel.items():
      _, h, k = users[0]
      used_by = ", ".join(name for name, _, _ in users)
      for dtype in DTYPES:
        out.append(Target("dense", PagedDecodeConfig(), dtype, h, k, d, used_by, True))
        out.append(Target("sparse", SparseDecodeConfig(), dtype, h, k, d, used_by, True))
    # The page-score kernel: with mean landmarks it depends on the head dim and the landmark
    # dtype only (the group mean is taken before it); with quest, also on the group (it
    # unrolls the group's heads).
    for kernel in ("scores", "scores_quest"):
      by_dim: dict = {}
      for name, (h, k, d) in _shapes(models).items():
        by_dim.setdefault((d, h // k if kernel == "scores_quest" else 0), []).append(
            (name, h, k))
      for (d, _), users in by_dim.items():
        _, h, k = users[0]
        for dtype in DTYPES:
          out.append(Target(kernel, None, dtype, h, k, d,
                            ", ".join(name for name, _, _ in users), True))
    for name, (h, k, d, page) in _small_page_shapes(models).items():
      for dtype in DTYPES:
        for kernel, cls in (("dense", PagedDecodeConfig), ("sparse", SparseDecodeConfig)):
          out.append(Target(kernel, split_k.default_config(cls, page), dtype, h, k, d, name,
                            True, page))
  if only in ("sweep", "all"):
    dense_sweep, sparse_cfg = _suite_dense_configs()
    h, k, d = SUITE_BENCH
    for cfg in dense_sweep[1:]:  # [0] is the default, compiled above
      out.append(Target("dense", cfg, "bfloat16", h, k, d, "gpu_suite sweep", False))
    if sparse_cfg != SparseDecodeConfig():
      out.append(Target("sparse", sparse_cfg, "bfloat16", h, k, d, "gpu_suite", False))
  return out


def _args(t: Target):
  b, p, m, n = 4, 64, 32, 67
  s = jax.ShapeDtypeStruct
  if t.kernel.startswith("scores"):  # q [B, H, D], landmark pool(s) [K, P, D], table, count
    pool = s((t.kv_heads, p, t.head_dim), t.dtype)
    return (s((b, t.heads, t.head_dim), jnp.bfloat16),
            (pool, pool) if t.kernel == "scores_quest" else pool,
            s((b, m), jnp.int32), s((b,), jnp.int32))
  base = (s((b, t.heads, t.head_dim), t.dtype),
          s((t.kv_heads, p, t.page_size, t.head_dim), t.dtype),
          s((t.kv_heads, p, t.page_size, t.head_dim), t.dtype),
          s((b, m), jnp.int32), s((b,), jnp.int32))
  if t.kernel == "dense":
    return base
  return base + (s((b, t.kv_heads, n), jnp.int32), s((b, t.kv_heads, n), jnp.bool_))


def kernel_fn(t: Target):
  """The function compiling `t` launches its kernel through."""
  if t.kernel.startswith("scores"):
    return functools.partial(page_scores.page_scores,
                             kind="quest" if t.kernel == "scores_quest" else "mean")
  return functools.partial(paged_decode if t.kernel == "dense" else sparse_decode,
                           config=t.config)


def config_text(cfg, kernel: str = "") -> str:
  if cfg is None:  # the page-score kernel: its default block per landmark kind
    block = (page_scores.QUEST_PAGES_PER_BLOCK if kernel == "scores_quest"
             else page_scores.DEFAULT_PAGES_PER_BLOCK)
    return f"page_scores(pages_per_block={block})"
  fields = dataclasses.asdict(cfg)
  default = dataclasses.asdict(type(cfg)())
  changed = {k: v for k, v in fields.items() if v != default[k]}
  return (f"{type(cfg).__name__}(" + ", ".join(f"{k}={v}" for k, v in changed.items()) + ")")


def compile_target(t: Target, limits: gpu_compile.GpuLimits = gpu_compile.H200) -> dict:
  """One JSON row: kernel, config, dtype, registers, spill_bytes, shared_bytes and the rest."""
  row = dict(kernel=t.kernel, config=config_text(t.config, t.kernel), dtype=t.dtype,
             head_dim=t.head_dim, group=t.group, page_size=t.page_size, used_by=t.used_by,
             gating=t.gating)
  try:
    (res,) = gpu_compile.compile_fn(kernel_fn(t), *_args(t), limits=limits)
  except ValueError as e:  # the config's own shared-memory check refused the block shape
    row.update(registers=None, spill_bytes=None, shared_bytes=None, status="REFUSED",
               problems=[str(e)])
    return row
  problems = res.problems(limits)
  status = "ok"
  if res.spill_bytes:
    status = "SPILL"
  if res.shared_bytes > limits.shared_per_block:
    status = "SMEM"
  row.update(registers=res.registers, spill_bytes=res.spill_bytes,
             shared_bytes=res.shared_bytes, num_warps=res.num_warps, num_stages=res.num_stages,
             blocks_per_sm=res.blocks_per_sm, occupancy=round(res.occupancy, 4),
             shared_floor_bytes=0 if t.config is None else split_k.shared_bytes_lower_bound(
                 pages_per_block=t.config.pages_per_block, page_size=t.page_size,
                 head_dim=t.head_dim, dtype=t.dtype, num_stages=t.config.num_stages),
             status=status, problems=problems)
  return row


def print_table(rows) -> None:
  print("| kernel | config | dtype | D | G | registers | spill B | shared KiB | blocks/SM | "
        "occupancy | used by | status |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    if r["registers"] is None:
      print(f"| {r['kernel']} | {r['config']} | {r['dtype']} | {r['head_dim']} | {r['group']} "
            f"| - | - | - | - | - | {r['used_by']} | {r['status']} |")
      continue
    print(f"| {r['kernel']} | {r['config']} | {r['dtype']} | {r['head_dim']} | {r['group']} "
          f"| {r['registers']} | {r['spill_bytes']} | {r['shared_bytes'] / 1024:.1f} "
          f"| {r['blocks_per_sm']} | {100 * r['occupancy']:.0f}% | {r['used_by']} "
          f"| {r['status']} |")


# ---------------------------------------------------------------------------------------------
# Split-K launch table (before / after sizing the splits)

SPLIT_PRESETS = {  # run preset -> (model, schedule); 64 slots, 2,048 + 32,768 tokens
    "qwen3_1p7b": ("qwen3_1p7b", "qwen3-1.7b-0.86"),
    "qwen3_4b": ("qwen3_4b", "qwen3-4b-0.86"),
    "qwen3_8b": ("qwen3_8b", "qwen3-8b-0.86"),
    "qwen3_14b": ("qwen3_14b", "qwen3-14b-0.86"),
}
SPLIT_BATCHES = (64, 16, 4, 1)
MAX_LEN = 2048 + 32768


def split_rows() -> list[dict]:
  from sparrow_jax.schedule import get_schedule
  from sparrow_jax.pallas_kernels.selection import num_selected_slots

  old_dense = PagedDecodeConfig(k_splits=8)
  old_sparse = SparseDecodeConfig(k_splits=8)
  rows = []
  for preset, (model, sched_name) in SPLIT_PRESETS.items():
    mc = MODEL_PRESETS[model]
    sched = get_schedule(sched_name)
    g, k, d = mc.num_heads // mc.num_kv_heads, mc.num_kv_heads, mc.head_dim
    slots = num_selected_slots(max(sched.budgets), sched.reserved_bos, sched.reserved_recent)
    dense_blocks = -(-(-(-MAX_LEN // PAGE_SIZE)) // PagedDecodeConfig().pages_per_block)
    sparse_blocks = -(-slots // SparseDecodeConfig().pages_per_block)
    for batch in SPLIT_BATCHES:
      for kernel, new, old, blocks in (("dense", PagedDecodeConfig(), old_dense, dense_blocks),
                                       ("sparse", SparseDecodeConfig(), old_sparse,
                                        sparse_blocks)):
        kw = dict(batch=batch, kv_heads=k, group=g, head_dim=d, num_blocks=blocks)
        before = split_k.launch_summary(old, **kw)
        before["partial_rows"] = max(split_k.MIN_DOT, split_k.next_pow2(g))  # padded group
        before["partial_bytes"] = (batch * k * 8 * before["partial_rows"] * (d + 2) * 4)
        after = split_k.launch_summary(new, **kw)
        rows.append(dict(preset=preset, kernel=kernel, batch=batch, group=g, blocks=blocks,
                         before=before, after=after))
  return rows


def print_split_table(rows) -> None:
  print("| preset | kernel | batch | G | key blocks | splits before -> after | programs "
        "before -> after | partial KiB before -> after |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    b, a = r["before"], r["after"]
    print(f"| {r['preset']} | {r['kernel']} | {r['batch']} | {r['group']} | {r['blocks']} | "
          f"{b['k_splits']} -> {a['k_splits']} | {b['programs']} -> {a['programs']} | "
          f"{b['partial_bytes'] / 1024:.0f} -> {a['partial_bytes'] / 1024:.0f} |")


PTX_SHAPE = dict(batch=16, heads=16, kv_heads=8, head_dim=128, pool_pages=4096,
                 table_pages=2048, schedule="qwen3-1.7b-0.86")


def ptx_rows(out_dir: str) -> list[dict]:
  """Compile the dense and sparse default kernels at `PTX_SHAPE`, write `{kernel}.ttgir` /
  `.ptx` into `out_dir`, return per kernel its resources and `ptx_memory_ops` counts."""
  from sparrow_jax.schedule import get_schedule
  from sparrow_jax.pallas_kernels.selection import num_selected_slots

  z = PTX_SHAPE
  sched = get_schedule(z["schedule"])
  slots = num_selected_slots(max(sched.budgets), sched.reserved_bos, sched.reserved_recent)
  s = jax.ShapeDtypeStruct
  b, kvh, d = z["batch"], z["kv_heads"], z["head_dim"]
  pool = s((kvh, z["pool_pages"], PAGE_SIZE, d), jnp.bfloat16)
  base = (s((b, z["heads"], d), jnp.bfloat16), pool, pool, s((b, z["table_pages"]), jnp.int32),
          s((b,), jnp.int32))
  sel = (s((b, kvh, slots), jnp.int32), s((b, kvh, slots), jnp.bool_))
  os.makedirs(out_dir, exist_ok=True)
  rows = []
  for kernel, fn, args in (
      ("dense", functools.partial(paged_decode, config=PagedDecodeConfig()), base),
      ("sparse", functools.partial(sparse_decode, config=SparseDecodeConfig()), base + sel)):
    (call,) = gpu_compile.triton_calls(fn, *args)
    stages: dict = {}
    res = gpu_compile.compile_call(call, stages_out=stages)
    for stage in ("ttgir", "ptx"):
      with open(os.path.join(out_dir, f"{kernel}.{stage}"), "w") as f:
        f.write(stages[stage])
    rows.append(dict(kernel=kernel, slots=slots if kernel == "sparse" else None,
                     registers=res.registers, spill_bytes=res.spill_bytes,
                     shared_bytes=res.shared_bytes, num_warps=res.num_warps,
                     num_stages=res.num_stages, blocks_per_sm=res.blocks_per_sm,
                     **{("kernel_ops" if k == "kernel" else k): v
                        for k, v in gpu_compile.ptx_memory_ops(stages["ptx"]).items()}))
  return rows


def print_ptx_table(rows) -> None:
  ops = sorted({k for r in rows for k in r["loop"]})
  print("| kernel | registers | shared KiB | blocks/SM | loop PTX lines | "
        + " | ".join(ops) + " |")
  print("|---" * (5 + len(ops)) + "|")
  for r in rows:
    print(f"| {r['kernel']} | {r['registers']} | {r['shared_bytes'] / 1024:.1f} | "
          f"{r['blocks_per_sm']} | {r['loop_lines']} | "
          + " | ".join(str(r["loop"].get(op, 0)) for op in ops) + " |")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default="sm_90", help="GPU target (only sm_90, the H200)")
  ap.add_argument("--json", action="store_true", help="print the rows as JSON, last line")
  ap.add_argument("--only", default="all", help="defaults | sweep | all")
  ap.add_argument("--models", default="", help="comma-separated model presets (defaults only)")
  ap.add_argument("--splits", action="store_true", help="print the split-K launch table only")
  ap.add_argument("--ptx", default="", metavar="DIR",
                  help="write the dense and sparse kernels' TTGIR / PTX into DIR and print "
                       "their block loops' memory instructions")
  args = ap.parse_args(argv)
  if args.target != "sm_90":
    print(f"kernel_compile: --target={args.target!r}: expected 'sm_90' (H200)", file=sys.stderr)
    return 2
  if args.only not in ("defaults", "sweep", "all"):
    print(f"kernel_compile: --only={args.only!r}: expected defaults, sweep or all",
          file=sys.stderr)
    return 2
  models = [m.strip() for m in args.models.split(",") if m.strip()]
  unknown = [m for m in models if m not in MODEL_PRESETS]
  if unknown:
    print(f"kernel_compile: --models {unknown}: expected model presets {sorted(MODEL_PRESETS)}",
          file=sys.stderr)
    return 2
  if args.ptx:
    try:
      rows = ptx_rows(args.ptx)
    except gpu_compile.TritonIRUnavailable as e:
      print(f"kernel_compile: {e}", file=sys.stderr)
      return 2
    print_ptx_table(rows)
    if args.json:
      print(json.dumps(rows))
    return 0
  if args.splits:
    rows = split_rows()
    print_split_table(rows)
    if args.json:
      print(json.dumps(rows))
    return 0
  rows = []
  for t in targets(args.only, models):
    try:
      rows.append(compile_target(t))
    except gpu_compile.TritonIRUnavailable as e:
      print(f"kernel_compile: {e}", file=sys.stderr)
      return 2
    if not args.json:
      r = rows[-1]
      print(f"  {r['kernel']:6s} {r['config']:45s} {r['dtype']:9s} D={r['head_dim']} "
            f"G={r['group']}: {r['status']}", file=sys.stderr, flush=True)
  print(f"Target {gpu_compile.H200.name}: {gpu_compile.H200.shared_per_block} bytes of shared "
        f"memory per block, {gpu_compile.H200.registers_per_sm} registers per SM.")
  print_table(rows)
  failed = [p for r in rows if r["gating"] and r["status"] != "ok" for p in r["problems"]]
  for p in failed:
    print(f"FAIL {p}", file=sys.stderr)
  if args.json:
    print(json.dumps(rows))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
