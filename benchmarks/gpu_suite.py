"""One-shot GPU suite: kernel checks, bandwidths and the dense baseline, into one JSON file.

    python benchmarks/gpu_suite.py --out gpu_suite.json              # one H200, < 10 minutes, not j
    python benchmarks/gpu_suite.py --sections a,c --out part.json    # some sections only
    python benchmarks/gpu_suite.py --sections e --contexts 32768 --out e.json  # one context
    python benchmarks/gpu_suite.py --smoke --out /tmp/smoke.json     # CPU, interpret mode
    python benchmarks/gpu_suite.py --sections j --step-lengths 8192 --budget-s 570 --out j.json

Sections (registered in `SECTIONS`; `--sections` takes their letters or names):
  a kernels_vs_reference  compiled sparse and dense kernels (and the dense XLA path) against
                          the float32 references at a few realistic shapes, and the page-score
                          kernel against the XLA scores; fails the run on a mismatch.
  b copy_bandwidth        device memory bandwidth of an elementwise pass over a large buffer
                          (bytes read + written / time): the roofline the kernels are held to.
  c sparse_bandwidth      the sparse kernel at batch 64, 32K context, Qwen3-1.7B attention
                          (16 q / 8 kv heads x 128, bf16 cache, page 16), budgets 64-512 pages:
                          bytes of the selected K/V pages / kernel time, and as % of (b); page
                          scoring (landmark gather + scores in XLA, and the page-score
                          kernel) with float32 and with bf16 landmarks, top-k, and the whole
                          sparse step (kernel scoring + top-k + kernel) with either landmark
                          dtype; per budget the kernel with no slot valid (its fixed cost)
                          and `sweep`: the kernel with other launches (8 pages per block, 3
                          stages, 8 warps; `Sizes.sparse_sweep`).
  d dense_baseline        dense paged decode at the same shape: our kernel (a few launch
                          configs), jax's `pallas.ops.gpu.paged_attention` and the XLA path, in
                          ms and GB/s of the sequences' own K/V pages.
  e engine_decode         the generation engine's decode step, dense vs the published
                          `qwen3-1.7b-0.86` schedule, random-init Qwen3-1.7B (bf16, the
                          preset's bf16 landmarks, the page-score kernel), at 32K/16K/8K
                          tokens held, as many sequences as the qwen3_1p7b preset's KV pool
                          holds at each (`--engine-batch`; 16 in runs 1-6 of 2026-12-04;
                          contexts filled with random K/V and their landmarks instead of a
                          prefill): ms/step, tokens/s, speedup.
  f readmission_agreement the same requests (temperature 1) through a pool that forces
                          preemptions and one that fits everyone, dense and block-sparse on
                          the kernel backend: on GPU a readmission's cache is recomputed by
                          the XLA prefill where the bf16 decode kernel first wrote it, so the
                          tokens after it agree up to bf16 rounding; counts how often they
                          are identical (2026-12-04 H200, random init, nearly flat next-token
                          distributions: 1 and 2 of 5 preempted requests, BENCHMARKS.md).
  g main_job              `python experiments/train.py --config tiny` (the README's main job,
                          the whole trainer with the kernels at 2-token pages) in a subprocess:
                          exit status, wall time and its summary.json.
  h preset_step           `train.py --config qwen3_1p7b` for three steps at Qwen3-1.7B's shapes
                          (random weights written as an HF directory, synthetic task, 64
                          rollouts of 128 new tokens): phase times per step (and compile_s),
                          rollout tokens/s, compilations, the final checkpoint.
  i engine_profile        section e's engines (sparse, then dense) at its first context under
                          the profiler: device time per decode step by kernel, from the
                          perfetto trace, beside the step's wall time; the page-score
                          kernel's time and share of the busiest stream.
  j step_dense_vs_sparse  Sparrow's Table 2 on this trainer: `Trainer(cfg).train_step()` of
                          the qwen3_1p7b preset (random weights written as an HF directory),
                          dense then the published schedule (bf16 landmarks, page-score
                          kernel) in one job process, 512-token prompts, responses forced to
                          8K then 16K tokens (`ignore_eos=true`), as many rollouts as the
                          memory plan's pool holds at once; one warm-up step then timed
                          steps: phase times, rollout tokens/s, sparse over dense for the
                          rollout and the step, beside the paper's figures. 16K only if 8K
                          finished and its wall time, scaled, fits what is left of the guard.
                          On a GPU it needs a call of its own (`--sections j`; one 8K step
                          of each engine takes minutes): a full run's default leaves it out.
  k async_vs_sync         `benchmarks/async_throughput.py` (issue 47): the same tiny-preset
                          config trained synchronously and with max_staleness=1
                          partial_rollouts=true on lognormal response lengths: trained
                          tokens/s, engine occupancy, decode steps per mode, the ratio. A
                          call of its own (`--sections k`), like j.
  l append_extend_vs_decode  the engine's append of environment tokens (issue 49): F = 64,
                          32, 16 tokens written at the ends of 32 sequences holding 8K tokens
                          each (random-init Qwen3-1.7B, bf16, random K/V and landmarks), by
                          one `Decoder.extend` call and by the F decode steps it replaced,
                          with the published schedule then dense: ms per append of each way,
                          decode over extend, max |logit difference| of the two ways.
Sections g, h, j and k run their jobs in their own processes and go first (this process does not
preallocate GPU memory, so those jobs get the device); then a-e, i, l and f (f last: the time
guard of a full run cuts it first).
A section is a function registered with `@section(letter, name, budget_s)`; it returns a dict of
its numbers. Every section gets a time guard (its budget, capped by what is left of
`--budget-s`): a measurement that would start past it is recorded under "skipped" instead, so
the whole run stays under 10 minutes. Timings are medians over `repeats` of `inner` back-to-back
calls after a warm-up (compile) call, with block_until_ready around each repeat.

The JSON holds `meta` (date, jax / jaxlib / plugin versions, device, platform version, argv)
and one entry per section: status ("ok", "partial" when the guard skipped something, "failed"
on a check mismatch, "error" with the traceback), wall seconds and its numbers. It is rewritten
after every section, so a run cut short keeps what it measured. Exit status: 0 when no section
failed or errored, 1 otherwise, 2 for bad arguments.

`--smoke` runs every section at tiny shapes on CPU with the kernels in interpret mode (minutes:
mostly compilation): the CI check that the suite itself works. The full run needs a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sparrow_jax.pallas_kernels import (dispatch, landmarks, page_scores,  # noqa: E402
                                        reference, selection)
from sparrow_jax.pallas_kernels.paged_decode import PagedDecodeConfig  # noqa: E402
from sparrow_jax.pallas_kernels.sparse_decode import SparseDecodeConfig  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
  """Shapes and repeat counts of one run (full GPU run or CPU smoke)."""
  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  page_size: int
  context: int
  budgets: tuple[int, ...]
  check_shapes: tuple[tuple[int, ...], ...]  # (batch, heads, kv_heads, head_dim, context)
  check_budget: int
  copy_mib: int
  repeats: int
  inner: int
  sparse_config: SparseDecodeConfig
  dense_configs: tuple[PagedDecodeConfig, ...]  # the first is the default
  jax_paged: dict  # launch arguments of jax's paged_attention
  # Section c: more sparse-kernel launches timed beside `sparse_config` at each budget
  # (issue 51: the sparse kernel's share of copy bandwidth by block size / stages / warps).
  sparse_sweep: tuple[SparseDecodeConfig, ...] = ()


FULL = Sizes(
    batch=64, heads=16, kv_heads=8, head_dim=128, page_size=16, context=32768,
    budgets=(64, 128, 256, 512),
    check_shapes=((8, 16, 8, 128, 8192), (4, 32, 8, 128, 4096), (4, 16, 2, 64, 2048)),
    check_budget=64, copy_mib=4096, repeats=7, inner=5,
    sparse_config=SparseDecodeConfig(),
    # The default sizes its splits to the work; k_splits=8 is the old fixed split count.
    # ppb=16 runs with 8 warps: at 4 it spills (benchmarks/kernel_compile.py).
    dense_configs=(PagedDecodeConfig(), PagedDecodeConfig(k_splits=8),
                   PagedDecodeConfig(k_splits=4), PagedDecodeConfig(k_splits=16),
                   PagedDecodeConfig(pages_per_block=4),
                   PagedDecodeConfig(pages_per_block=16, num_warps=8),
                   PagedDecodeConfig(num_warps=8), PagedDecodeConfig(num_stages=3)),
    jax_paged=dict(k_splits=16, pages_per_compute_block=8),
    # 8 pages = 128 keys per block, the dense default's block (docs/gpu/sparse_kernel_ptx.md)
    sparse_sweep=(SparseDecodeConfig(pages_per_block=8), SparseDecodeConfig(num_stages=3),
                  SparseDecodeConfig(pages_per_block=8, num_stages=3),
                  SparseDecodeConfig(pages_per_block=8, num_warps=8)))

SMOKE = Sizes(  # every code path once, at the smallest shapes the kernels accept
    batch=2, heads=16, kv_heads=2, head_dim=16, page_size=16, context=128, budgets=(1, 2),
    check_shapes=((2, 16, 2, 16, 128),), check_budget=2, copy_mib=4, repeats=2, inner=1,
    sparse_config=SparseDecodeConfig(k_splits=2, pages_per_block=1),
    dense_configs=(PagedDecodeConfig(k_splits=2, pages_per_block=1),),
    jax_paged=dict(k_splits=2, pages_per_compute_block=1),
    sparse_sweep=(SparseDecodeConfig(k_splits=2, pages_per_block=2),))


# Section e: the engine on a random-init model. The full run uses Qwen3-1.7B at the batch the
# qwen3_1p7b preset's KV pool holds at each context ("pool": ~20 sequences of 32K on an H200,
# the preset's 64 slots at 8K; the dense and sparse engines are built one after the other;
# runs 1-6 of 2026-12-04 used 16, `--engine-batch 16`). Longest context first: each context
# compiles its own decode programs, and a run the time guard cuts short should still have the
# one where sparsity matters most.
FULL_ENGINE = dict(model="qwen3_1p7b", overrides={}, batch="pool", chunk=8,
                   contexts=(32768, 16384, 8192))  # 8K measured on 2026-12-04: last
# Section f: requests, prompt / generated tokens, slots and the preempting pool (in sequences
# of the longest request it holds at once).
# (32 requests of 256 + 512 tokens took 216 s for the dense half on the H200, past the
# section's budget; 24 of 256 + 256 still ran past 230 s on 2026-12-04, after section e. On
# CPU such a half compiles 16 programs (6 for the pool that fits, 10 for the tight one, whose
# readmissions prefill at new lengths), ~10-20 s each for the 28-layer model on the H200. Now
# 4 of its layers (the engine unrolls layers: compile time goes with them) and half the
# tokens; the log and the JSON give each run's wall time and compilations. That took 151 s in
# run 4; now 2 layers (one dense, one sparse), and f runs last: the guard cuts it first.)
FULL_READMIT = dict(model="qwen3_1p7b", overrides=dict(num_layers=2), requests=16, prompt=128,
                    new=128, slots=8, pool_seqs=3, chunk=16, budget=8)
SMOKE_READMIT = dict(model="tiny", overrides=dict(num_layers=2, head_dim=16), requests=3,
                     prompt=8, new=16, slots=2, pool_seqs=1, chunk=4, budget=1)
SMOKE_ENGINE = dict(model="tiny", overrides=dict(num_layers=3, head_dim=16), batch=2, chunk=2,
                    contexts=(256,))


class Run:
  """What the sections share: sizes, backend, cache dtype, the time guard and a cache of
  built inputs / measured copy bandwidth."""

  def __init__(self, sizes: Sizes, smoke: bool, budget_s: float, *, backend=None,
               engine: dict | None = None, step: dict | None = None):
    self.sizes = sizes
    self.smoke = smoke
    if backend is None:
      backend = dispatch.Backend.PALLAS_INTERPRET if smoke else dispatch.Backend.PALLAS
    self.backend = backend
    self.dtype = jnp.bfloat16
    self.total_deadline = time.monotonic() + budget_s
    self.deadline = self.total_deadline
    self.skipped: list[str] = []
    self.cache: dict = {}
    self.engine = engine if engine is not None else (SMOKE_ENGINE if smoke else FULL_ENGINE)
    self.step = step if step is not None else (SMOKE_STEP if smoke else FULL_STEP)
    self._tmp: str | None = None

  def tmp_dir(self) -> str:
    """A directory that lives as long as the run (shared files: the random checkpoints)."""
    if self._tmp is None:
      import tempfile
      self._tmp = tempfile.mkdtemp(prefix="gpu_suite_")
    return self._tmp

  def close(self):
    if self._tmp is not None:
      import shutil
      shutil.rmtree(self._tmp, ignore_errors=True)
      self._tmp = None

  def start_section(self, budget_s: float):
    self.deadline = min(time.monotonic() + budget_s, self.total_deadline)
    self.skipped = []

  def has_time(self, label: str) -> bool:
    """False (and `label` recorded as skipped) once the section's guard has passed."""
    if time.monotonic() < self.deadline:
      return True
    self.skipped.append(label)
    return False

  def time_ms(self, fn, *args) -> float:
    """Median ms per call: warm-up (compile) excluded, `inner` calls per timed repeat."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(self.sizes.repeats):
      start = time.perf_counter()
      for _ in range(self.sizes.inner):
        out = fn(*args)
      jax.block_until_ready(out)
      times.append((time.perf_counter() - start) / self.sizes.inner)
    return 1e3 * statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Section:
  letter: str
  name: str
  budget_s: float
  run: Callable[[Run], dict]
  # Runs a job in its own process: such sections go first, while this process holds
  # (almost) no device memory.
  own_process: bool = False
  # Needs a call of its own on the device (longer than the whole run's guard): left out of a
  # full run's default sections (the smoke run has them all).
  own_call: bool = False


SECTIONS: dict[str, Section] = {}


def section(letter: str, name: str, budget_s: float, own_process: bool = False,
            own_call: bool = False):
  """Registers a section; its function takes the Run and returns a JSON-able dict."""
  def register(fn):
    SECTIONS[letter] = Section(letter, name, budget_s, fn, own_process, own_call)
    return fn
  return register


class CheckFailed(Exception):
  """A kernel disagrees with its reference; the section records it and the run exits 1."""


# ---------------------------------------------------------------------------------------------
# Inputs


def paged_case(run: Run, *, batch, heads, kv_heads, head_dim, context, seed=0, mixed=False):
  """Random paged cache of `batch` sequences in shuffled physical pages (page 0 is the null
  page). Lengths are context - 3 (a partial last page), or with `mixed` spread over
  [1, context] with one sequence of length 1 and one spanning the whole table.

  Returns q [B, H, D], k_pages, v_pages [K, P, S, D], table [B, M] int32, lengths [B] int32.
  """
  s = run.sizes.page_size
  m = -(-context // s)
  p = batch * m + 1
  rng = np.random.default_rng(seed)
  kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
  k_pages = jax.random.normal(kk, (kv_heads, p, s, head_dim), run.dtype)
  v_pages = jax.random.normal(kv, (kv_heads, p, s, head_dim), run.dtype)
  q = jax.random.normal(kq, (batch, heads, head_dim), run.dtype)
  table = jnp.asarray(1 + rng.permutation(batch * m).reshape(batch, m), jnp.int32)
  if mixed:
    lengths = rng.integers(1, context + 1, batch)
    lengths[0], lengths[-1] = context, 1
  else:
    lengths = np.full(batch, context - 3)
  return q, k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32)


def selected_pages(run: Run, case, budgets, max_budget):
  """Mean-landmark page selection of `case` for the sparse kernel: (page_idx, valid)."""
  q, k_pages, _, table, lengths = case
  s = run.sizes.page_size
  lm = landmarks.compute_landmarks(k_pages, jnp.full(k_pages.shape[:2], s), "mean")
  return selection.select_decode_pages(
      q, lm, table, lengths, jnp.asarray(budgets, jnp.int32), kind="mean",
      max_budget=max_budget, page_size=s, slot_multiple=run.sizes.sparse_config.slot_multiple())


def bench_case(run: Run):
  """The section c/d shape, built once per run."""
  if "bench_case" not in run.cache:
    z = run.sizes
    run.cache["bench_case"] = jax.block_until_ready(paged_case(
        run, batch=z.batch, heads=z.heads, kv_heads=z.kv_heads, head_dim=z.head_dim,
        context=z.context, seed=1))
  return run.cache["bench_case"]


def page_bytes(run: Run, num_pages) -> int:
  """Bytes of K and V in `num_pages` (kv head, page) pairs."""
  z = run.sizes
  return 2 * int(num_pages) * z.page_size * z.head_dim * jnp.dtype(run.dtype).itemsize


def copy_gbps(run: Run) -> float:
  if "copy_gbps" not in run.cache:
    n = run.sizes.copy_mib * 2 ** 20 // jnp.dtype(run.dtype).itemsize
    x = jax.block_until_ready(jnp.ones((n,), run.dtype))
    ms = run.time_ms(jax.jit(lambda a: a * 2), x)  # exact in bf16, cannot be elided
    run.cache["copy_gbps"] = 2 * x.nbytes / ms / 1e6
    run.cache["copy_ms"] = ms
    del x
  return run.cache["copy_gbps"]


def _rel_err(out, want) -> float:
  out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(out - want)) / max(np.max(np.abs(want)), 1e-30))


# ---------------------------------------------------------------------------------------------
# Sections


def _page_score_fns(run: Run):
  """Mean-landmark page scores the sections compare, jitted: (XLA's gather + `score_pages`
  (q, lm, table), the page-score kernel (q, lm, table, num_pages) or None where the backend
  scores in XLA)."""
  xla = jax.jit(lambda q, lm, table: landmarks.score_pages(
      q, landmarks.gather_landmarks(lm, table), "mean"))
  scorer = dispatch.page_scorer(run.backend)
  if scorer == "xla":
    return xla, None
  return xla, jax.jit(lambda q, lm, table, n: page_scores.page_scores(
      q, lm, table, n, interpret=scorer == "pallas_interpret"))


SCORE_TOL = 1e-5  # float32 page scores: the same sums, up to FMA contraction


@section("a", "kernels_vs_reference", budget_s=90)
def kernels_vs_reference(run: Run) -> dict:
  tol = 2e-2  # bf16 cache, float32 accumulation
  z = run.sizes
  checks = []
  for i, (batch, heads, kv_heads, head_dim, context) in enumerate(z.check_shapes):
    label = f"B={batch} H={heads} K={kv_heads} D={head_dim} ctx={context}"
    if not run.has_time(label):
      continue
    case = paged_case(run, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      context=context, seed=10 + i, mixed=True)
    budgets = np.random.default_rng(i).integers(0, z.check_budget + 1, batch)
    page_idx, valid = selected_pages(run, case, budgets, z.check_budget)
    # References with a float32 query return float32: the check sees the kernels' error,
    # not the rounding of the output to bf16.
    q32 = case[0].astype(jnp.float32)
    dense_ref = jax.jit(reference.dense_decode_reference)(q32, *case[1:])
    sparse_ref = jax.jit(reference.sparse_decode_reference)(q32, *case[1:], page_idx, valid)
    outs = {
        "dense_kernel": jax.jit(functools.partial(
            dispatch.dense_decode_attention, backend=run.backend,
            config=z.dense_configs[0]))(*case),
        "dense_xla": jax.jit(functools.partial(dispatch.dense_decode_attention,
                                               backend="xla"))(*case),
        "sparse_kernel": jax.jit(functools.partial(
            dispatch.sparse_decode_attention, backend=run.backend,
            config=z.sparse_config))(*case, page_idx, valid),
    }
    for impl, out in outs.items():
      want = sparse_ref if impl.startswith("sparse") else dense_ref
      err = _rel_err(out, want)
      checks.append(dict(shape=label, impl=impl, rel_err=err, ok=bool(err <= tol)))
    score_xla, score_kernel = _page_score_fns(run)
    if score_kernel is not None:  # the page-score kernel against the XLA scores
      q, k_pages, _, table, lengths = case
      lm = landmarks.compute_landmarks(k_pages, jnp.full(k_pages.shape[:2], k_pages.shape[2]),
                                       "mean")
      n = (lengths + z.page_size - 1) // z.page_size
      want, got = score_xla(q, lm, table), score_kernel(q, lm, table, n)
      exists = (jnp.arange(table.shape[1])[None, :] < n[:, None])[:, None, :]
      err = _rel_err(jnp.where(exists, got, 0.0), jnp.where(exists, want, 0.0))
      checks.append(dict(shape=label, impl="page_scores_kernel", rel_err=err,
                         ok=bool(err <= SCORE_TOL)))
  result = dict(tolerance=tol, score_tolerance=SCORE_TOL, checks=checks)
  bad = [c for c in checks if not c["ok"]]
  if bad:
    raise CheckFailed(json.dumps(bad))
  return result


@section("b", "copy_bandwidth", budget_s=30)
def copy_bandwidth(run: Run) -> dict:
  gbps = copy_gbps(run)
  return dict(buffer_mib=run.sizes.copy_mib, ms=run.cache["copy_ms"], gbps=gbps,
              note="x * 2 over a bf16 buffer: bytes read + written / time")


@section("c", "sparse_bandwidth", budget_s=120)
def sparse_bandwidth(run: Run) -> dict:
  """Per budget: the kernel alone (bytes of the selected K/V / time), top-k alone, and the whole
  step; page scoring (landmark gather + scores, independent of the budget) is timed once per
  landmark dtype: float32 and bfloat16 (`landmark_dtype`, half the bytes)."""
  z = run.sizes
  case = bench_case(run)
  q, k_pages, _, table, lengths = case
  copy = copy_gbps(run)
  lm32 = landmarks.compute_landmarks(k_pages, jnp.full(k_pages.shape[:2], z.page_size), "mean")
  by_dtype = {"float32": lm32, "bfloat16": lm32.astype(jnp.bfloat16)}  # [K, P, D]
  score, score_kernel = _page_score_fns(run)
  num_pages = (lengths + z.page_size - 1) // z.page_size
  scorer = dispatch.page_scorer(run.backend)
  score_ms, score_kernel_ms, lm_bytes = {}, {}, {}
  for name, lm in by_dtype.items():
    if run.has_time(f"score {name}"):
      score_ms[name] = run.time_ms(score, q, lm, table)
      if score_kernel is not None:  # the Triton page-score kernel (not on the TPU backends)
        score_kernel_ms[name] = run.time_ms(score_kernel, q, lm, table, num_pages)
      lm_bytes[name] = int(np.prod(table.shape)) * z.kv_heads * z.head_dim * lm.dtype.itemsize
  scores = score(q, lm32, table)  # [B, K, M]
  slot_multiple = z.sparse_config.slot_multiple()
  rows = []
  for budget in z.budgets:
    if not run.has_time(f"budget {budget}"):
      continue
    budgets = jnp.full((z.batch,), budget, jnp.int32)
    page_idx, valid = selected_pages(run, case, budgets, budget)
    attend = jax.jit(functools.partial(dispatch.sparse_decode_attention, backend=run.backend,
                                       config=z.sparse_config))
    kernel_ms = run.time_ms(attend, *case, page_idx, valid)
    nbytes = page_bytes(run, valid.sum())
    # The same call with no slot valid: launch, slot resolution, empty programs and the merge
    # (the fixed cost; 2026-12-04's four budgets fit kernel_ms ~ 0.070 ms + bytes / 2,358 GB/s)
    empty_ms = run.time_ms(attend, *case, page_idx, jnp.zeros_like(valid))
    sweep = []
    for cfg in z.sparse_sweep:
      if not run.has_time(f"budget {budget} {cfg}"):
        continue
      ms = run.time_ms(jax.jit(functools.partial(
          dispatch.sparse_decode_attention, backend=run.backend, config=cfg)),
          *case, page_idx, valid)
      sweep.append(dict(config=dataclasses.asdict(cfg), kernel_ms=ms,
                        kernel_gbps=nbytes / ms / 1e6, pct_of_copy=100 * nbytes / ms / 1e6 / copy))
    topk = jax.jit(functools.partial(selection.select_pages, max_budget=budget,
                                     slot_multiple=slot_multiple))
    topk_ms = run.time_ms(topk, scores, num_pages, budgets)

    def step(q, k_pages, v_pages, table, lengths, lm, budgets, max_budget):
      idx, ok = selection.select_decode_pages(
          q, lm, table, lengths, budgets, kind="mean", max_budget=max_budget,
          page_size=z.page_size, slot_multiple=slot_multiple, scorer=scorer)
      return dispatch.sparse_decode_attention(q, k_pages, v_pages, table, lengths, idx, ok,
                                              backend=run.backend, config=z.sparse_config)

    step_fn = jax.jit(functools.partial(step, max_budget=budget))
    step_ms = {name: run.time_ms(step_fn, *case, lm, budgets) for name, lm in by_dtype.items()}
    gbps = nbytes / kernel_ms / 1e6
    rows.append(dict(budget=budget, selected_pages=int(valid.sum()), kv_bytes=nbytes,
                     kernel_ms=kernel_ms, kernel_gbps=gbps, pct_of_copy=100 * gbps / copy,
                     kernel_ms_no_pages=empty_ms,
                     pct_of_copy_past_fixed=(100 * nbytes / (kernel_ms - empty_ms) / 1e6 / copy
                                             if kernel_ms > empty_ms else None),
                     topk_ms=topk_ms, step_ms=step_ms["float32"],
                     step_ms_bf16_landmarks=step_ms["bfloat16"], sweep=sweep))
  run.cache["sparse_step_ms"] = {r["budget"]: r["step_ms_bf16_landmarks"] for r in rows}
  return dict(shape=_bench_shape(run), config=dataclasses.asdict(z.sparse_config),
              copy_gbps=copy, score_ms=score_ms, score_kernel_ms=score_kernel_ms,
              landmark_bytes=lm_bytes, rows=rows)


@section("d", "dense_baseline", budget_s=150)
def dense_baseline(run: Run) -> dict:
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

  z = run.sizes
  case = bench_case(run)
  q, k_pages, v_pages, table, lengths = case
  copy = copy_gbps(run)
  own_pages = z.kv_heads * int(jnp.sum((lengths + z.page_size - 1) // z.page_size))
  nbytes = page_bytes(run, own_pages)
  rows, outs = [], {}

  def record(impl, fn, config=None):
    if not run.has_time(impl if config is None else f"{impl} {config}"):
      return
    ms = run.time_ms(fn, *case)
    if impl not in outs:
      outs[impl] = fn(*case)
    rows.append(dict(impl=impl, config=config, ms=ms, gbps=nbytes / ms / 1e6,
                     pct_of_copy=100 * nbytes / ms / 1e6 / copy))

  for config in z.dense_configs:
    record("dense_kernel", jax.jit(functools.partial(
        dispatch.dense_decode_attention, backend=run.backend, config=config)),
        dataclasses.asdict(config))
  scale = z.head_dim ** -0.5  # jax's kernel applies no softmax scale: fold it into q

  def jax_kernel(q, k_pages, v_pages, table, lengths):
    return jax_paged.paged_attention(q * jnp.asarray(scale, q.dtype), k_pages, v_pages, table,
                                     lengths, interpret=run.smoke, **z.jax_paged)

  record("jax_paged_attention", jax.jit(jax_kernel), dict(z.jax_paged))
  record("dense_xla", jax.jit(functools.partial(dispatch.dense_decode_attention,
                                                backend="xla")))
  agreement = {impl: _rel_err(out, outs["dense_xla"]) for impl, out in outs.items()
               if "dense_xla" in outs and impl != "dense_xla"}
  # Same shape, same run: the default dense kernel's time over section c's whole sparse step
  # (scoring with bf16 landmarks + top-k + kernel) per budget, when c ran.
  dense_ms = next((r["ms"] for r in rows if r["impl"] == "dense_kernel"), None)
  speedup = {budget: dense_ms / ms for budget, ms in run.cache.get("sparse_step_ms", {}).items()
             } if dense_ms else {}
  return dict(shape=_bench_shape(run), own_kv_bytes=nbytes, copy_gbps=copy, rows=rows,
              rel_diff_vs_xla=agreement, dense_over_sparse_step=speedup)


FILL_PIECE_PAGES = 1024  # pages of one layer the context filler writes per loop iteration


# One layer per call, donated, and within it pieces of `FILL_PIECE_PAGES` pages written in
# place by a loop: the temporaries stay a piece's (at 32K x 16 sequences of Qwen3-1.7B the
# pool is ~60 GB; all 28 layers in one program asked for 22 GB of temporaries on the H200,
# and one whole layer's float32 keys for the landmarks, 2 GiB, still failed to find room
# beside the pool on 2026-12-04).
def make_fill_layer(kind: str, piece_pages: int = FILL_PIECE_PAGES):
  """fill_layer(k, v, landmarks, key) -> the same buffers (donated) holding random K/V and the
  landmarks of those keys, written `piece_pages` pages at a time."""

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def fill_layer(k, v, old_lms, key):
    heads, pages = k.shape[:2]
    piece = min(pages, piece_pages)
    shape = (heads, piece) + k.shape[2:]

    def body(i, carry):
      k, v, lms = carry
      start = jnp.minimum(i * piece, pages - piece)  # the last piece overlaps the one before
      k1, k2 = jax.random.split(jax.random.fold_in(key, i))
      kp = jax.random.normal(k1, shape, k.dtype)
      k = jax.lax.dynamic_update_slice_in_dim(k, kp, start, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(
          v, jax.random.normal(k2, shape, v.dtype), start, axis=1)
      if kind != "none":
        lm = landmarks.compute_landmarks(kp, jnp.full(shape[:2], shape[2]), kind)
        lm = lm if isinstance(lm, tuple) else (lm,)
        lms = tuple(jax.lax.dynamic_update_slice_in_dim(old, x.astype(old.dtype), start, axis=1)
                    for x, old in zip(lm, lms))
      return k, v, lms

    return jax.lax.fori_loop(0, -(-pages // piece), body, (k, v, tuple(old_lms)))

  return fill_layer


def fill_random_context(engine, num_seqs: int, context: int, seed: int = 0):
  """Admit `num_seqs` sequences holding `context` tokens each into `engine` without a prefill:
  every pool page gets random K/V (decode cost does not depend on the values) and landmarks
  computed from those keys (so sparse steps select pages as they would). Returns the host
  state of a generate call (`engine._begin`) the engine's decode chunks run against."""
  from sparrow_jax.engine.engine import Request
  from sparrow_jax.engine.sampling import SamplingParams

  c = engine.config
  reqs = [Request([3] * context, SamplingParams(temperature=0.0, ignore_eos=True,
                                               max_new_tokens=c.max_seq_len - context), i)
          for i in range(num_seqs)]
  run = engine._begin(reqs)
  admitted = run.sched.admit()
  assert len(admitted) == num_seqs, "the pool must hold every sequence"
  for sq in admitted:
    sq.tokens[0], sq.num_tokens, sq.length = 5, 1, context  # one pending token on top
  fill_layer = make_fill_layer(engine._landmark)
  kv, key = engine._kv, jax.random.key(seed)
  engine._kv = None
  ks, vs, lms = [], [], []
  for i in range(len(kv.k)):
    k, v, lm = fill_layer(kv.k[i], kv.v[i], kv.landmarks[i], jax.random.fold_in(key, i))
    jax.block_until_ready(k)
    ks.append(k)
    vs.append(v)
    lms.append(lm)
  lengths = jnp.zeros_like(kv.lengths).at[:num_seqs].set(context)
  engine._kv = kv.replace(k=tuple(ks), v=tuple(vs), landmarks=tuple(lms), lengths=lengths)
  return run


def _preset_landmark_dtype(model: str) -> str:
  """The landmark dtype the training preset of `model` runs its sparse actor with (bfloat16
  on the GPU presets, float32 on the CPU ones), float32 for a model without a preset."""
  from sparrow_jax.run.config import PRESETS
  preset = PRESETS.get(model)
  return preset.landmark_dtype if preset is not None else "float32"


def _engine_parts(run: Run, max_position: int):
  """What sections e and i build their engines from: the random-init bf16 model of
  `run.engine`, the published schedule, and the dense and sparse attention (the sparse one
  with the landmark dtype of the model's training preset, budgets up to `max_position`)."""
  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.decoder import init_model
  from sparrow_jax.schedule import get_schedule
  from sparrow_jax.schedule.schedule import attention_spec

  z = run.engine
  mcfg = get_config(z["model"], dtype="bfloat16", param_dtype="bfloat16", **z["overrides"])
  sched_ = get_schedule("qwen3-1.7b-0.86")
  backend = run.backend.value
  sparse = attention_spec(sched_, max_position=max_position, backend=backend,
                          landmark_dtype=_preset_landmark_dtype(z["model"]))
  return mcfg, init_model(mcfg), sched_, attn_lib.Dense(backend=backend), sparse


def _engine_config(run: Run, context: int, chunks: int, page_size: int, batch: int):
  """The engine of sections e and i: `batch` slots, room for `context` tokens plus `chunks`
  + 2 decode chunks."""
  from sparrow_jax.engine.engine import EngineConfig

  z = run.engine
  return EngineConfig(num_slots=batch, max_seq_len=_engine_seq_len(run, context, chunks,
                                                                   page_size),
                      page_size=page_size, decode_chunk=z["chunk"])


def _engine_seq_len(run: Run, context: int, chunks: int, page_size: int) -> int:
  return context + run.engine["chunk"] * (chunks + 2) + page_size


def engine_batch(run: Run, context: int, chunks: int, page_size: int,
                 device_bytes: float | None = None) -> int:
  """Sequences of sections e and i at `context` tokens: `run.engine["batch"]`, or with
  "pool" as many as the KV pool of the model's training preset holds (the pool the trainer's
  memory plan gives its engine on this device, or on `device_bytes` per device), capped at
  the preset's slots."""
  z = run.engine
  if z["batch"] != "pool":
    return int(z["batch"])
  from sparrow_jax.run.config import PRESETS
  from sparrow_jax.run.dry_run import memory_plan
  from sparrow_jax.run.memory import device_memory_bytes

  cfg = PRESETS[z["model"]]
  dev = jax.devices()[0]
  plan = memory_plan(cfg, 1, device_bytes=device_bytes or device_memory_bytes(
      dev, cfg.device_memory_gb * 1e9)[0])
  per_seq = -(-_engine_seq_len(run, context, chunks, page_size) // page_size)
  return max(1, min(cfg.num_slots, (plan.kv_pool_pages - 1) // per_seq))  # less the null page


def decode_step_ms(run: Run, engine, state, steps: int) -> float:
  """Median ms per decode step over `repeats` chunks (the first, compiling one, excluded)."""
  times = []
  for r in range(run.sizes.repeats + 1):
    t0 = time.perf_counter()
    engine._decode_chunk(state, state.sched.grow())
    jax.block_until_ready(engine._kv.k[0])
    if r:
      times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times) / steps


@section("e", "engine_decode", budget_s=200)
def engine_decode(run: Run) -> dict:
  """Engine decode tokens/s, dense vs the published qwen3-1.7b-0.86 schedule, random-init
  Qwen3-1.7B (bf16), at 32K, 16K and 8K tokens held; per context the dense engine, then
  the sparse one, with the landmark dtype of the model's training preset (bf16; float32 in
  runs 1-6 of 2026-12-04); at the first context also the sparse engine with XLA page scoring
  (`BlockSparse.page_scorer="xla"`) where the backend scores with the kernel."""
  from sparrow_jax.engine.engine import GenerationEngine
  from sparrow_jax.schedule.schedule import budget_pages

  z = run.engine
  mcfg, model, sched_, dense_att, sparse_att = _engine_parts(run, max(z["contexts"]) + 1024)
  rows = []
  for ctx in z["contexts"]:
    if not run.has_time(f"context {ctx}"):
      continue
    steps = z["chunk"]
    batch = engine_batch(run, ctx, run.sizes.repeats, sched_.page_size)
    ecfg = _engine_config(run, ctx, run.sizes.repeats, sched_.page_size, batch)
    out, errors = {}, {}
    engines = [("dense", dense_att, None), ("sparse", sparse_att, sched_)]
    if ctx == z["contexts"][0] and dispatch.page_scorer(run.backend) != "xla":
      # the first context also with the XLA page scoring the kernel replaced (2026-12-04)
      engines.append(("sparse_xla_scores",
                      dataclasses.replace(sparse_att, page_scorer="xla"), sched_))
    for name, att, sch in engines:
      eng = sched = None
      try:
        eng = GenerationEngine(model, ecfg, attention=att, schedule=sch)
        sched = fill_random_context(eng, batch, ctx)
        out[name] = decode_step_ms(run, eng, sched, steps)
        print(f"[e] {ctx} {name}: {out[name]:.3f} ms/step", flush=True)
      except jax.errors.JaxRuntimeError as e:  # e.g. out of memory at one context: the
        errors[name] = str(e).split("\n")[0][:300]  # other contexts are still measured
      del eng, sched
      gc.collect()
    budget = int(budget_pages(sched_, ctx))
    if errors:
      rows.append(dict(context=ctx, batch=batch, budget_pages=budget, errors=errors,
                       **{f"{k}_ms": v for k, v in out.items()}))
      continue
    row = dict(context=ctx, batch=batch, budget_pages=budget,
               dense_ms=out["dense"], sparse_ms=out["sparse"],
               dense_tok_s=batch * 1e3 / out["dense"],
               sparse_tok_s=batch * 1e3 / out["sparse"],
               speedup=out["dense"] / out["sparse"])
    if "sparse_xla_scores" in out:
      row.update(sparse_xla_scores_ms=out["sparse_xla_scores"],
                 speedup_xla_scores=out["dense"] / out["sparse_xla_scores"])
    rows.append(row)
  if rows and all("errors" in r for r in rows):
    raise CheckFailed(f"no context measured: {[r['errors'] for r in rows]}")
  return dict(model=mcfg.name, layers=mcfg.num_layers, schedule=sched_.name,
              landmark_dtype=sparse_att.landmark_dtype, rows=rows,
              note="contexts filled with random K/V and their landmarks; bf16 weights/cache")


def trace_summary(trace_dir: str, steps: int, top: int = 30) -> dict:
  """Device time by kernel from the perfetto trace `jax.profiler.trace(create_perfetto_trace=
  True)` wrote under `trace_dir`: per thread of the device processes (GPU streams; the host's
  XLA threads on CPU), microseconds per decode step of every kernel name, its calls per step
  and the thread's busy time per step; the `top` largest kernels of each thread, and the `top`
  largest groups of kernels that differ only by XLA's numbering (`kernel_group`)."""
  import collections
  import glob
  import gzip

  paths = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise CheckFailed(f"no perfetto trace under {trace_dir}")
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e["args"]["name"]
  device_pids = {pid for pid, name in procs.items() if "/device:" in name}
  if not device_pids:  # CPU: the XLA client's threads of the host process
    device_pids = set(procs)
  busy = collections.defaultdict(float)
  kernels = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in device_pids:
      continue
    thread = f"{procs[e['pid']]} / {threads.get((e['pid'], e['tid']), e['tid'])}"
    if thread.endswith("/ python") or e["name"].startswith(("end: ", "$")):
      continue
    busy[thread] += e["dur"]
    k = kernels[thread][e["name"]]
    k[0] += e["dur"]
    k[1] += 1
    if len(k) == 2:  # what the first call says about the kernel (its HLO op, module)
      k.append({a: str(v)[:200] for a, v in (e.get("args") or {}).items()
                if a in ("hlo_op", "hlo_module", "long_name", "tf_op")})
  out = {}
  for thread, total in sorted(busy.items(), key=lambda kv: -kv[1]):
    rows = sorted(kernels[thread].items(), key=lambda kv: -kv[1][0])[:top]
    groups = collections.defaultdict(lambda: [0.0, 0])
    for name, k in kernels[thread].items():
      g = groups[kernel_group(name)]
      g[0] += k[0]
      g[1] += k[1]
    out[thread] = dict(busy_us_per_step=total / steps,
                       kernels=[dict(name=n[:160], us_per_step=k[0] / steps,
                                     calls_per_step=k[1] / steps, **k[2])
                                for n, k in rows],
                       groups=[dict(group=n[:160], us_per_step=d / steps,
                                    calls_per_step=c / steps)
                               for n, (d, c) in sorted(groups.items(),
                                                       key=lambda kv: -kv[1][0])[:top]])
  return out


def page_scoring_share(threads: dict) -> dict:
  """The page-score kernel's device time per step (kernels named `page_scores`) and its share
  of the busiest device thread's time (the GPU stream; on CPU the interpreter's ops carry no
  such name and the share is 0)."""
  if not threads:
    return dict(page_scores_us_per_step=0.0, page_scoring_share=0.0)
  busiest = max(threads.values(), key=lambda t: t["busy_us_per_step"])
  us = float(sum(g["us_per_step"] for g in busiest["groups"] if "page_scores" in g["group"]))
  return dict(page_scores_us_per_step=us,
              page_scoring_share=us / busiest["busy_us_per_step"] if us else 0.0)


def kernel_group(name: str) -> str:
  """A kernel's name without XLA's numbering: `sort_57_1` -> `sort`, `gemm_fusion_dot_111` ->
  `gemm_fusion_dot`, `loop_select_fusion_2` -> `loop_select_fusion` (unrolled layers give
  every layer's copy of an op its own name; the group sums them)."""
  return re.sub(r"(?:[._]\d+)+$", "", name) or name


@section("i", "engine_profile", budget_s=120)
def engine_profile(run: Run) -> dict:
  """Where the sparse engine's decode step goes: the engine of section e (published schedule,
  16 sequences) at its first context, a few decode chunks under the profiler, device time by
  kernel per step (`trace_summary`) beside the step's wall time; then the same for the dense
  engine. On 2026-12-04 the sparse step at 32K took 12.96 ms where its bytes allow ~6.6."""
  import tempfile

  from sparrow_jax.engine.engine import GenerationEngine

  z = run.engine
  ctx, steps, chunks = z["contexts"][0], z["chunk"], 3
  # section e's engines (the same static max budget: contexts + 1024 positions)
  mcfg, model, sched_, dense_att, sparse_att = _engine_parts(run, max(z["contexts"]) + 1024)
  batch = engine_batch(run, ctx, chunks, sched_.page_size)
  ecfg = _engine_config(run, ctx, chunks, sched_.page_size, batch)
  result = dict(model=mcfg.name, layers=mcfg.num_layers, schedule=sched_.name, context=ctx,
                batch=batch, steps=steps * chunks, landmark_dtype=sparse_att.landmark_dtype)
  for name, att, sch in (("sparse", sparse_att, sched_), ("dense", dense_att, None)):
    if not run.has_time(name):
      continue
    eng = GenerationEngine(model, ecfg, attention=att, schedule=sch)
    state = fill_random_context(eng, batch, ctx)
    eng._decode_chunk(state, state.sched.grow())  # compile
    jax.block_until_ready(eng._kv.k[0])
    with tempfile.TemporaryDirectory() as tmp:
      t0 = time.perf_counter()
      with jax.profiler.trace(tmp, create_perfetto_trace=True):
        for _ in range(chunks):
          eng._decode_chunk(state, state.sched.grow())
        jax.block_until_ready(eng._kv.k[0])
      wall = time.perf_counter() - t0
      threads = trace_summary(tmp, steps * chunks)
      result[name] = dict(wall_ms_per_step_profiled=1e3 * wall / (steps * chunks),
                          threads=threads, **page_scoring_share(threads))
    print(f"[i] {ctx} {name}: profiled", flush=True)
    del eng, state
    gc.collect()
  return result


# Section l: the append of a resumed sequence's environment tokens (`GenerationEngine._append`)
# as one chunked prefill at the sequences' ends (`Decoder.extend`) against the loop of decode
# steps it replaced (issue 49). Sequences, tokens each already holds, chunk widths (tokens
# appended per sequence, the engine's `_APPEND_CHUNK` first) timed in this order.
FULL_APPEND = dict(batch=32, context=8192, chunks=(64, 32, 16))
SMOKE_APPEND = dict(batch=2, context=200, chunks=(16,))  # 200: the chunk crosses a page


def _append_cache(run: Run, mcfg, att, batch: int, context: int, max_chunk: int,
                  page_size: int, seed: int = 0):
  """A paged cache of `batch` sequences holding `context` tokens each (random K/V and the
  landmarks of those keys in every page, `make_fill_layer`, written in place), with pages for
  `max_chunk` more per sequence in shuffled physical pages; bf16 like the engine's pool, the
  landmarks of `att` (none for dense)."""
  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models.kv_cache import PagedKVCache

  sparse = isinstance(att, attn_lib.BlockSparse)
  kind = att.landmark if sparse else "none"
  per_seq = -(-(context + max_chunk) // page_size)
  cache = PagedKVCache.create(
      num_layers=mcfg.num_layers, num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
      num_slots=batch, num_pages=batch * per_seq + 1, max_pages_per_seq=per_seq,
      page_size=page_size, dtype=jnp.dtype(mcfg.dtype), landmark=kind,
      landmark_dtype=att.landmark_dtype if sparse else "float32")
  fill_layer = make_fill_layer(kind)
  key = jax.random.key(seed)
  ks, vs, lms = [], [], []
  for i in range(cache.num_layers):
    k, v, lm = fill_layer(cache.k[i], cache.v[i], cache.landmarks[i], jax.random.fold_in(key, i))
    jax.block_until_ready(k)
    ks.append(k)
    vs.append(v)
    lms.append(lm)
  rng = np.random.default_rng(seed)
  table = 1 + rng.permutation(batch * per_seq).reshape(batch, per_seq)
  return cache.replace(k=tuple(ks), v=tuple(vs), landmarks=tuple(lms),
                       page_table=jnp.asarray(table, jnp.int32),
                       lengths=jnp.full((batch,), context, jnp.int32))


def _append_fns(graphdef, att, sched_):
  """(extend, decode), jitted with the cache donated as the engine's programs donate it: one
  chunk `[n, F]` appended by `Decoder.extend` (budgets `budget_pages` at each query's position
  + 1), or one decode step (budgets at `lengths + 1`); `table` the schedule's budgets as a
  traced input, as the engine passes them (None for dense)."""
  from flax import nnx

  from sparrow_jax.schedule.schedule import budget_pages

  @functools.partial(jax.jit, donate_argnums=(1,))
  def extend(state, cache, tokens, n_in, slots, table):
    budgets = None
    if sched_ is not None:
      pos = cache.lengths[slots][:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
      budgets = budget_pages(sched_, pos + 1, table)
    return nnx.merge(graphdef, state).extend(cache, tokens, n_in, slots, attention=att,
                                             budgets=budgets)

  @functools.partial(jax.jit, donate_argnums=(1,))
  def decode(state, cache, tok, active, table):
    budgets = None if sched_ is None else budget_pages(sched_, cache.lengths + 1, table)
    return nnx.merge(graphdef, state).decode(cache, tok, active, attention=att,
                                             budgets=budgets)

  return extend, decode


@section("l", "append_extend_vs_decode", budget_s=150)
def append_extend_vs_decode(run: Run) -> dict:
  """The engine's append (issue 49): F environment tokens written at the ends of `batch`
  sequences holding `context` tokens each, random-init model of `run.engine` (Qwen3-1.7B,
  bf16) dense and with the published schedule (section e's attention), two ways on the same
  cache: one `Decoder.extend` call, and the F decode steps it replaced (one jitted call per
  token, all sequences active, budgets by position). Per (attention, F): ms per append of
  each way (median over `repeats`, the compiling call excluded; every call starts from the
  same `context` lengths and donates the cache, as the engine's programs do), decode over
  extend, and the largest |difference| of the two ways' final logits (bf16 rounding only)."""
  from flax import nnx

  z = SMOKE_APPEND if run.smoke else FULL_APPEND
  b, ctx, chunks = z["batch"], z["context"], tuple(z["chunks"])
  # the sparse attention's static max budget: what positions up to ctx + F ask for
  mcfg, model, sched_, dense_att, sparse_att = _engine_parts(run, ctx + max(chunks))
  page = sched_.page_size
  graphdef, state = nnx.split(model)
  table = jnp.asarray(sched_.budgets, jnp.int32)
  rng = np.random.default_rng(0)
  rows, errors = [], {}
  slots = jnp.arange(b, dtype=jnp.int32)
  active = jnp.ones((b,), bool)

  def timed(call, cache):
    """Median ms of `repeats` calls (the first, compiling one excluded), each from `ctx`
    tokens held: (cache, the last call's logits, ms)."""
    times, logits = [], None
    for r in range(run.sizes.repeats + 1):
      cache = cache.replace(lengths=jnp.full((b,), ctx, jnp.int32))  # a fresh (donated) copy
      jax.block_until_ready(cache.lengths)
      t0 = time.perf_counter()
      cache, logits = call(cache)
      jax.block_until_ready((cache, logits))
      if r:
        times.append(time.perf_counter() - t0)
    return cache, logits, 1e3 * statistics.median(times)

  # the sparse attention first: the engine's sparse actor is what appends tool responses
  for name, att, sch in (("sparse", sparse_att, sched_), ("dense", dense_att, None)):
    if not run.has_time(name):
      continue
    cache = None
    try:
      extend, decode = _append_fns(graphdef, att, sch)
      tab = None if sch is None else table
      cache = _append_cache(run, mcfg, att, b, ctx, max(chunks), page)
      for f in chunks:
        if not run.has_time(f"{name} F={f}"):
          continue
        tokens = jnp.asarray(rng.integers(1, mcfg.vocab_size, (b, f)), jnp.int32)
        n_in = jnp.full((b,), f, jnp.int32)
        cols = [tokens[:, j] for j in range(f)]

        def by_extend(c):
          return extend(state, c, tokens, n_in, slots, tab)

        def by_decode(c):
          for tok in cols:
            c, logits = decode(state, c, tok, active, tab)
          return c, logits

        cache, ext_logits, ext_ms = timed(by_extend, cache)
        cache, dec_logits, dec_ms = timed(by_decode, cache)
        ext_logits, dec_logits = (np.asarray(x, np.float32) for x in (ext_logits, dec_logits))
        rows.append(dict(attention=name, chunk=f, extend_ms=ext_ms, decode_loop_ms=dec_ms,
                         decode_step_ms=dec_ms / f, ratio=dec_ms / ext_ms,
                         extend_tok_s=b * f * 1e3 / ext_ms, decode_tok_s=b * f * 1e3 / dec_ms,
                         max_abs_logit_diff=float(np.max(np.abs(ext_logits - dec_logits))),
                         max_abs_logit=float(np.max(np.abs(dec_logits)))))
        print(f"[l] {name} F={f}: extend {ext_ms:.3f} ms, {f} decode steps {dec_ms:.3f} ms "
              f"({dec_ms / ext_ms:.2f}x)", flush=True)
    except jax.errors.JaxRuntimeError as e:  # e.g. out of memory: the other attention runs
      errors[name] = str(e).split("\n")[0][:300]
    del cache
    gc.collect()
  if errors and not rows:
    raise CheckFailed(f"nothing measured: {errors}")
  return dict(model=mcfg.name, layers=mcfg.num_layers, schedule=sched_.name,
              landmark_dtype=sparse_att.landmark_dtype, batch=b, context=ctx, page_size=page,
              chunks=list(chunks), rows=rows, errors=errors,
              note="contexts filled with random K/V and their landmarks; bf16 weights/cache")


@section("f", "readmission_agreement", budget_s=150)
def readmission_agreement(run: Run) -> dict:
  """Tokens of preempted (and readmitted) requests against a pool that fits everyone."""
  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
  from sparrow_jax.engine.sampling import SamplingParams
  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.decoder import init_model

  z = SMOKE_READMIT if run.smoke else FULL_READMIT
  dtype = "float32" if run.smoke else "bfloat16"
  mcfg = get_config(z["model"], dtype=dtype, param_dtype=dtype, eos_token_ids=(),
                    **z["overrides"])
  model = init_model(mcfg)
  page = run.sizes.page_size
  rng = np.random.default_rng(0)
  reqs = [Request(list(rng.integers(3, mcfg.vocab_size, z["prompt"])),
                  SamplingParams(temperature=1.0, max_new_tokens=z["new"], seed=i), i)
          for i in range(z["requests"])]
  max_len = z["prompt"] + z["new"]
  per_seq = -(-max_len // page)
  # The kernels in interpret mode compile for minutes; the CPU smoke checks the section on XLA.
  backend = "xla" if run.smoke else run.backend.value
  rows = []
  for name, att in (("dense", attn_lib.Dense(backend=backend)),
                    ("sparse", attn_lib.BlockSparse(max_budget=z["budget"], page_size=page,
                                                    dense_layers=(0,), backend=backend))):
    if not run.has_time(name):
      continue
    base = dict(num_slots=z["slots"], max_seq_len=max_len, page_size=page,
                decode_chunk=z["chunk"])
    outs, stats = {}, {}
    for pool, extra in (("fits", {}), ("tight", dict(num_pages=z["pool_seqs"] * per_seq + 1))):
      eng = GenerationEngine(model, EngineConfig(**base, **extra), attention=att)
      outs[pool], stats[pool] = eng.generate(reqs), eng.last_stats
      st = stats[pool]  # progress for the log (a GPU run that hits the outer timeout)
      print(f"[f] {name}/{pool}: {st['wall_s']:.1f} s, {st['compilations']} compilations, "
            f"{st['preemptions']} preemptions", flush=True)
      del eng
    pre = [i for i, c in enumerate(outs["tight"]) if c.preemptions]
    same_prefix = total = identical = 0
    for i in pre:
      a, b = outs["fits"][i].token_ids, outs["tight"][i].token_ids
      n = min(len(a), len(b))
      diff = np.flatnonzero(a[:n] != b[:n])
      same_prefix += int(diff[0]) if diff.size else n
      total += max(len(a), len(b))
      identical += int(len(a) == len(b) and not diff.size)
    rows.append(dict(attention=name, preemptions=int(stats["tight"]["preemptions"]),
                     wall_s={p: round(st["wall_s"], 2) for p, st in stats.items()},
                     compilations={p: int(st["compilations"]) for p, st in stats.items()},
                     preempted_requests=len(pre), identical_requests=identical,
                     identical_frac=identical / len(pre) if pre else None,
                     prefix_agreement=same_prefix / total if total else None))
  if rows and not any(r["preempted_requests"] for r in rows):
    raise CheckFailed("the tight pool preempted nothing: the section measured nothing")
  return dict(model=mcfg.name, layers=mcfg.num_layers, dtype=dtype, requests=z["requests"],
              prompt=z["prompt"], new=z["new"], rows=rows,
              note="tokens of preempted requests vs a pool that fits everyone; "
                   "prefix_agreement = tokens before the first difference / tokens")


# Section g: the README's main job. The full run is the embedded default as the README gives
# it; the smoke run (CPU) one step of it, to check the section itself (CI runs the whole job
# in tests/test_cli.py::test_readme_first_hour_as_written).
MAIN_JOB_FULL = ("--config", "tiny")
MAIN_JOB_SMOKE = ("--config", "tiny", "num_steps=1", "warmstart_steps=0")


@section("g", "main_job", budget_s=150, own_process=True)
def main_job(run: Run) -> dict:
  """`python experiments/train.py --config tiny` (the README's main job) in a subprocess on
  this machine's default backend: on a GPU its rollouts run the Triton kernels at the tiny
  preset's 2-token pages, the trainer's jitted steps on the device. Fails on a non-zero exit
  or a run that does not finish inside the section's time guard."""
  import tempfile

  args = MAIN_JOB_SMOKE if run.smoke else MAIN_JOB_FULL
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "run")
    _, wall = _run_job(run, "the main job", [
        _script("experiments", "train.py"), *args, f"out_dir={out}", "tensorboard=false",
        "--quiet"])
    summary = _summary(out)
  return dict(command="python experiments/train.py " + " ".join(args), wall_s=round(wall, 2),
              summary=summary)


def _script(*parts) -> str:
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", *parts)


# What main() set in the environment for this process only (the own-process jobs run with
# the user's environment).
_SUITE_ENV = dict(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_MEM_FRACTION="0.9")
_SET_ENV: list = []


def _run_job(run: Run, what: str, argv: list, env: dict | None = None):
  """`python argv...` inside the section's time guard, with the environment a user's run
  has; CheckFailed on a timeout or a non-zero exit. Returns (completed process, wall s)."""
  import subprocess
  root = _script()
  env = dict(os.environ if env is None else env,
             PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
  for name in _SET_ENV:
    env.pop(name, None)
  timeout = max(run.deadline - time.monotonic(), 1.0)
  start = time.perf_counter()
  try:
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired as e:
    raise CheckFailed(f"{what} did not finish in {timeout:.0f} s; its last output: "
                      f"{_text(e.stderr)[-1500:]}") from None
  if proc.returncode != 0:
    raise CheckFailed(f"{what} exited {proc.returncode}: {proc.stderr[-1500:]}")
  return proc, time.perf_counter() - start


def _text(out) -> str:
  return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _read_steps(out_dir: str) -> list[dict]:
  """The per-step records a training run has written so far (its metrics.jsonl)."""
  from sparrow_jax.run.metrics import read_jsonl
  path = os.path.join(out_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  return [{k: r[k] for k in ("step", *_STEP_KEYS) if k in r}
          for _, r in sorted(read_jsonl(path).items())]


def _summary(out_dir: str) -> dict:
  """The summary a finished training run wrote (what train.py prints as `summary: ...`)."""
  path = os.path.join(out_dir, "summary.json")
  if not os.path.exists(path):
    raise CheckFailed(f"the run wrote no {path}")
  with open(path) as f:
    return json.load(f)


# Section h: a GPU training preset's own step at its model's shapes: random weights of the
# preset's model written as an HF directory (byte tokenizer, the model's own vocabulary), then
# `train.py --config <preset> model_path=...` on the synthetic task for a few steps. Random
# weights never stop early, so every rollout runs to max_new_tokens: the lengths and the batch
# are cut to fit the section's budget (each page-table width of a 28-layer decode loop is a
# compile of its own: 128 new tokens keep it to two or three); everything else (dtypes,
# remat, micro-batch token budget, memory-sized KV pool, schedule, kernels) is the preset's.
PRESET_STEP_FULL = dict(preset="qwen3_1p7b", args=(
    "data=synthetic:arithmetic", "reward=exact_match", "prompts_per_step=8",
    "max_new_tokens=128", "num_steps=3"))
PRESET_STEP_SMOKE = dict(preset="tiny", args=("num_steps=1", "warmstart_steps=0"))

_WRITE_RANDOM_CHECKPOINT = """
import json
import sys
from sparrow_jax.models.checkpoints import save_pretrained
from sparrow_jax.models.checkpoints.byte_tokenizer import ByteTokenizer
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
name, path = sys.argv[1:3]
overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
tok = ByteTokenizer()
cfg = get_config(name, dtype="bfloat16", param_dtype="bfloat16", bos_token_id=tok.bos_token_id,
                 eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id, **overrides)
assert tok.vocab_size <= cfg.vocab_size
save_pretrained(init_model(cfg, seed=0), path, tokenizer=tok)
"""

_STEP_KEYS = ("time/step_s", "time/compile_s", "time/rollout_s", "time/recompute_s",
              "time/update_s", "rollout/tokens", "rollout/tokens_per_s", "rollout/decode_steps",
              "rollout/preemptions", "rollout/pool_high_water_frac", "response/len_mean",
              "batch/micro_batches", "compilations", "mismatch/p5_overall", "loss/total",
              "grad_norm")


def random_checkpoint(run: Run, model: str, overrides: dict | None = None) -> tuple[str, float]:
  """(path, seconds it took to write) of an HF directory with random weights of `model`
  (`ModelConfig` overrides applied), written once per run on the host CPU (this process and
  the jobs keep the device to themselves) and shared by the sections that train it."""
  overrides = overrides or {}
  key = ("checkpoint", model, json.dumps(overrides, sort_keys=True))
  if key not in run.cache:
    path = os.path.join(run.tmp_dir(), f"model_{len(run.cache)}")
    _, write_s = _run_job(run, "writing the random checkpoint",
                          ["-c", _WRITE_RANDOM_CHECKPOINT, model, path, json.dumps(overrides)],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    run.cache[key] = (path, write_s)
    return path, write_s
  return run.cache[key][0], 0.0  # written by an earlier section


@section("h", "preset_step", budget_s=300, own_process=True)
def preset_step(run: Run) -> dict:
  """`train.py --config qwen3_1p7b` for three steps on this GPU at Qwen3-1.7B's shapes (random
  weights, 64 rollouts of 128 new tokens): per-step phase times and the part of them that was
  compilation (step 2 compiled the update again on 2026-12-04: a new length bucket), rollout
  tokens/s, pool use, compilations, and the final checkpoint written. Fails on a non-zero exit
  or the guard."""
  import tempfile

  z = PRESET_STEP_SMOKE if run.smoke else PRESET_STEP_FULL
  ckpt, write_s = random_checkpoint(run, z["preset"])
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "run")
    args = (f"--config {z['preset']}", *z["args"])
    try:
      _, wall = _run_job(run, f"train.py --config {z['preset']}", [
          _script("experiments", "train.py"), "--config", z["preset"], *z["args"],
          f"model_path={ckpt}", f"out_dir={out}", "tensorboard=false", "--quiet"])
    except CheckFailed as e:  # what it did before it failed or ran out of time
      raise CheckFailed(f"{e}\nsteps written: {json.dumps(_read_steps(out))}") from None
    steps, summary = _read_steps(out), _summary(out)
    saved = sorted(os.listdir(os.path.join(out, "checkpoints")))
  return dict(command="python experiments/train.py " + " ".join(args)
              + " model_path=<random weights>", checkpoint_write_s=round(write_s, 2),
              wall_s=round(wall, 2), summary=summary, checkpoints=saved, steps=steps)


# Section j: Sparrow's Table 2 on this trainer: whole GRPO steps of a GPU preset, dense against
# the published schedule (the preset's bf16 landmarks, the page-score kernel), both in one
# process, at response lengths where sparsity pays. Responses are forced to `length` tokens
# (`ignore_eos=true`: random weights would otherwise stop anywhere), prompts are `prompt_len`
# tokens of text, and the batch is what the memory plan's KV pool holds at the longest
# sequence (a multiple of the group size and of the preset's mini-batch), so the rollout runs
# every sequence at once. `warmup_steps` steps (compilation) then `timed_steps` steps per
# engine; a longer length is measured only if the one before it finished, and only when the
# time left allows it (the shorter length's wall time, scaled by the length).
FULL_STEP = dict(preset="qwen3_1p7b", model="qwen3_1p7b", model_overrides={},
                 lengths=(8192, 16384), prompt_len=512, batch=0, warmup_steps=1,
                 timed_steps=1, sparse=("schedule=qwen3-1.7b-0.86", "landmark_dtype=bfloat16",
                                        "page_scorer=auto"), overrides=())
# Smoke: the tiny model with 3 layers (the schedule's 2 dense + 1 sparse), pages of 16 tokens
# (the published schedule's), DistillSparse off as on the GPU presets.
SMOKE_STEP = dict(preset="tiny", model="tiny", model_overrides=dict(num_layers=3),
                  lengths=(8, 16), prompt_len=24, batch=8, warmup_steps=1, timed_steps=1,
                  sparse=FULL_STEP["sparse"],
                  overrides=("page_size=16", "dense_layers=", "distill=false", "group_size=4",
                             "warmstart_steps=0", "num_slots=8"))
# Sparrow's Table 2 (4x H200, tau = 0.86): sparse over dense for the rollout and the whole step,
# and the release's tokens/s for Qwen3-1.7B.
PAPER_TABLE2 = {"qwen3_1p7b": dict(rollout_speedup=2.21, step_speedup=1.97,
                                   rollout_tokens_per_s_dense=2561,
                                   rollout_tokens_per_s_sparse=5662),
                "qwen3_4b": dict(rollout_speedup=2.41, step_speedup=2.11),
                "qwen3_8b": dict(rollout_speedup=2.06, step_speedup=1.81)}

_STEP_JOB = """
import os
import sys
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # as train.py: the plan's 90%
sys.path.insert(0, sys.argv[1])
import gpu_suite
sys.exit(gpu_suite.step_job(sys.argv[2], sys.argv[3]))
"""


@section("j", "step_dense_vs_sparse", budget_s=570, own_process=True, own_call=True)
def step_dense_vs_sparse(run: Run) -> dict:
  """Whole GRPO steps of `run.step`'s preset, dense and sparse in one job process
  (`step_job`): per length the phase times of each, rollout tokens/s, and sparse over dense
  for the rollout and the step, beside Sparrow's Table 2. A job cut short by the guard keeps
  the lengths it finished (status "partial")."""
  import tempfile

  z = run.step
  ckpt, write_s = random_checkpoint(run, z["model"], z["model_overrides"])
  tmp = tempfile.mkdtemp(dir=run.tmp_dir(), prefix="step_")
  spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
  # the job's own guard ends 20 s before the section's, which kills the job
  spec = dict(z, model_path=ckpt, tmp=tmp,
              time_s=max(run.deadline - time.monotonic() - 20.0, 1.0))
  _write(spec_path, spec)
  try:
    _run_job(run, "the step job", ["-c", _STEP_JOB, os.path.dirname(os.path.abspath(__file__)),
                                   spec_path, out_path])
    error = None
  except CheckFailed as e:
    error = str(e)
  result = {}
  if os.path.exists(out_path):  # what the job wrote, finished or not
    with open(out_path) as f:
      result = json.load(f)
  done = [r for r in result.get("lengths", []) if "step_speedup" in r]
  if error is not None:
    if not done:
      raise CheckFailed(f"{error}\njob output so far: {json.dumps(result)[-3000:]}")
    run.skipped.append(f"the job stopped: {error[:500]}")
  run.skipped.extend(result.get("skipped", []))
  unforced = [r["length"] for r in done if not r["forced_length"]]
  if unforced:  # the two engines did not generate the same tokens: no comparison
    raise CheckFailed(f"responses not forced to lengths {unforced} (rollout/tokens != batch x "
                      f"length): {json.dumps(result)[-3000:]}")
  return dict(result, checkpoint_write_s=round(write_s, 2),
              paper_table2=PAPER_TABLE2.get(z["model"]))


def _step_config(spec: dict, length: int, mode: str, batch: int | None = None,
                 mini_batch: int | None = None):
  """The TrainConfig of one engine of the step job at response `length` (`mode` "dense" or
  "sparse"); `batch` rollouts per step (None: the preset's)."""
  from sparrow_jax.run.config import get_train_config

  tmp = spec["tmp"]
  args = [f"model_path={spec['model_path']}", f"data={os.path.join(tmp, 'prompts.jsonl')}",
          "reward=exact_match", f"max_prompt_len={spec['prompt_len']}",
          f"max_new_tokens={length}", "ignore_eos=true",
          f"num_steps={spec['warmup_steps'] + spec['timed_steps']}",
          f"out_dir={os.path.join(tmp, f'{mode}_{length}')}", "tensorboard=false", "logger=none",
          "sample_every=0", f"compile_cache_dir={os.path.join(tmp, 'compile_cache')}",
          *spec["overrides"]]
  args += ["schedule=dense"] if mode == "dense" else list(spec["sparse"])
  cfg = get_train_config(spec["preset"], args)
  if batch is not None:
    # every sequence in a slot of its own: the rollout runs the whole batch at once
    cfg = cfg.replace(prompts_per_step=batch // cfg.group_size,
                      num_slots=-(-batch // jax.device_count()), mini_batch_size=mini_batch)
  return cfg


def pool_batch(cfg, device_bytes: float | None = None) -> tuple[int, dict]:
  """Rollouts per step that the memory plan's KV pool holds at once at `cfg`'s longest
  sequence, over this machine's devices, as a multiple of the group size and of the
  mini-batch (or the group size alone, one update, when the mini-batch does not fit);
  returns (batch, what the plan said). `device_bytes`: plan for this much memory per device
  instead of this machine's (as the trainer does: its allocator's limit)."""
  from sparrow_jax.run.builders import model_config
  from sparrow_jax.run.dry_run import plan_for_model
  from sparrow_jax.run.memory import device_memory_bytes

  dev, n = jax.devices()[0], jax.device_count()
  mcfg = model_config(cfg)
  nbytes = device_bytes or device_memory_bytes(dev, cfg.device_memory_gb * 1e9)[0]
  slots = cfg.num_slots
  for _ in range(8):  # the plan caps what it holds at its slots: more slots until it is not
    plan = plan_for_model(cfg.replace(num_slots=slots), mcfg, n, device_bytes=nbytes,
                          activation_dtype="float32" if dev.platform == "cpu" else None)
    if plan.concurrency["at_max"] < slots:
      break
    slots *= 2
  held = plan.concurrency["at_max"] * n
  unit = math.lcm(cfg.group_size, cfg.mini_batch_size) if cfg.mini_batch_size else \
      cfg.group_size
  if held < unit:
    unit = cfg.group_size
  return held // unit * unit, dict(kv_pool_pages=plan.kv_pool_pages,
                                   sequences_held=held, kv_pool_gb=plan.kv_cache_bytes / 1e9)


def _write_prompts(path: str, prompt_len: int, count: int):
  """`count` prompts of `prompt_len` - 4 characters (byte tokenizer: a token each, plus bos)."""
  with open(path, "w") as f:
    for i in range(count):
      text = f"Problem {i}: add the numbers below and give the sum in a box. "
      text += " + ".join(str(7 * i + j) for j in range(prompt_len))
      f.write(json.dumps(dict(prompt=text[:prompt_len - 4], answer="0")) + "\n")


def _steps_of(cfg, steps: int) -> list[dict]:
  """`steps` train steps of a fresh `Trainer(cfg)` through its public API: their metrics."""
  from sparrow_jax.run.trainer import Trainer

  tr = Trainer(cfg, quiet=True)
  try:
    out = []
    for _ in range(steps):
      m = tr.train_step()
      out.append({k: float(m[k]) for k in _STEP_KEYS if m.get(k) is not None})
      print(f"[j] {cfg.schedule} {cfg.max_new_tokens}: step {len(out)} "
            f"{out[-1].get('time/step_s', 0):.2f} s", flush=True)
    return out
  finally:
    tr.close()
    del tr
    gc.collect()


def _engine_summary(steps: list[dict], warmup: int) -> dict:
  """Medians over the timed steps (after `warmup`) of the phase times; rollout tokens/s as
  tokens over rollout seconds."""
  timed = steps[warmup:]
  med = lambda k: statistics.median(s.get(k, 0.0) for s in timed)
  out = dict(step_s=med("time/step_s"), rollout_s=med("time/rollout_s"),
             recompute_s=med("time/recompute_s"), update_s=med("time/update_s"),
             compile_s=med("time/compile_s"), rollout_tokens=med("rollout/tokens"))
  out["rollout_tokens_per_s"] = out["rollout_tokens"] / out["rollout_s"]
  return dict(out, steps=steps)


def step_job(spec_path: str, out_path: str) -> int:
  """Section j's measurement, in a process of its own (the trainers own the device): per
  length, a trainer with the dense schedule then one with the sparse, `warmup_steps` +
  `timed_steps` steps each; writes `out_path` after every engine (a job killed by the
  section's guard keeps what it finished)."""
  with open(spec_path) as f:
    spec = json.load(f)
  deadline = time.monotonic() + spec["time_s"]
  result = dict(preset=spec["preset"], prompt_len=spec["prompt_len"],
                warmup_steps=spec["warmup_steps"], timed_steps=spec["timed_steps"],
                sparse=list(spec["sparse"]), lengths=[], skipped=[])
  _write(out_path, result)
  prev = None  # (length, wall s) of the last length measured
  for i, length in enumerate(spec["lengths"]):
    left = deadline - time.monotonic()
    need = prev[1] * length / prev[0] if prev else 0.0
    if left <= 0 or need > left:
      result["skipped"].extend(
          f"length {n}: ~{need:.0f} s needed, {left:.0f} s left" if n == length else
          f"length {n}: after {length}" for n in spec["lengths"][i:])
      break
    t0 = time.monotonic()
    base = _step_config(spec, length, "sparse")
    if spec["batch"]:
      batch, pool = spec["batch"], None
    else:
      batch, pool = pool_batch(base)
    mini = base.mini_batch_size if base.mini_batch_size and batch % base.mini_batch_size == 0 \
        else 0
    _write_prompts(os.path.join(spec["tmp"], "prompts.jsonl"), spec["prompt_len"],
                   4 * max(batch // base.group_size, 1))
    row = dict(length=length, batch=batch, group_size=base.group_size,
               mini_batch_size=mini, pool=pool)
    result["lengths"].append(row)
    _write(out_path, result)
    if batch < base.group_size:
      result["skipped"].append(f"length {length}: the pool holds {batch} sequences, under "
                               f"one group of {base.group_size}")
      break
    for mode in ("dense", "sparse"):
      if time.monotonic() >= deadline:
        result["skipped"].append(f"length {length} {mode}: time guard")
        break
      cfg = _step_config(spec, length, mode, batch, mini)
      row[mode] = _engine_summary(_steps_of(cfg, spec["warmup_steps"] + spec["timed_steps"]),
                                  spec["warmup_steps"])
      # what the closed trainer left allocated (the next one plans with the whole device)
      stats = jax.devices()[0].memory_stats() or {}
      row[mode]["device_bytes_in_use_after"] = stats.get("bytes_in_use")
      _write(out_path, result)
    if "sparse" not in row:
      result["skipped"].extend(f"length {n}: after {length}" for n in spec["lengths"][i + 1:])
      break
    d, s = row["dense"], row["sparse"]
    row.update(step_dense_s=d["step_s"], step_sparse_s=s["step_s"],
               rollout_dense_s=d["rollout_s"], rollout_sparse_s=s["rollout_s"],
               rollout_tokens_per_s_dense=d["rollout_tokens_per_s"],
               rollout_tokens_per_s_sparse=s["rollout_tokens_per_s"],
               rollout_speedup=d["rollout_s"] / s["rollout_s"],
               step_speedup=d["step_s"] / s["step_s"],
               forced_length=all(st.get("rollout/tokens") == batch * length
                                 for st in d["steps"] + s["steps"]),
               wall_s=round(time.monotonic() - t0, 2))
    _write(out_path, result)
    prev = (length, time.monotonic() - t0)
  return 0


# Section k: synchronous vs asynchronous training steps (issue 47) on this machine's default
# backend: benchmarks/async_throughput.py in a subprocess, its last stdout line parsed. The
# full run is the benchmark's own default comparison (tiny preset, lognormal response lengths,
# max_staleness=1 partial_rollouts=true against max_staleness=0, A B A B steps) at a longer
# median and cap than on the CPU, so decode chunks rather than step overheads fill the step;
# the smoke run is its `--smoke`.
ASYNC_FULL = ("--steps", "8", "--warmup", "3", "--median", "64", "--max-new", "512",
              "--prompts", "8", "--group", "8")
ASYNC_SMOKE = ("--smoke",)


@section("k", "async_vs_sync", budget_s=300, own_process=True, own_call=True)
def async_vs_sync(run: Run) -> dict:
  """Trained tokens per second of wall time, engine occupancy and decode steps of the same
  config run synchronously and asynchronously (`benchmarks/async_throughput.py`); fails when
  the job fails or prints no result."""
  args = ASYNC_SMOKE if run.smoke else ASYNC_FULL
  proc, wall = _run_job(run, "the async throughput job",
                        [_script("benchmarks", "async_throughput.py"), *args])
  lines = proc.stdout.strip().splitlines()
  try:
    result = json.loads(lines[-1])
  except (IndexError, json.JSONDecodeError):
    raise CheckFailed(f"the async throughput job printed no JSON line: {proc.stdout[-1500:]}")
  return dict(command="python benchmarks/async_throughput.py " + " ".join(args),
              wall_s=round(wall, 2), result=result,
              modes=[l for l in lines if l.startswith(("sync:", "async:", "response lengths"))])


def _bench_shape(run: Run) -> dict:
  z = run.sizes
  return dict(batch=z.batch, heads=z.heads, kv_heads=z.kv_heads, head_dim=z.head_dim,
              page_size=z.page_size, context=z.context, dtype=jnp.dtype(run.dtype).name)


# ---------------------------------------------------------------------------------------------
# Driver


def _versions() -> dict:
  out = {"jax": jax.__version__, "python": platform.python_version()}
  for dist in importlib.metadata.distributions():
    name = dist.metadata["Name"] or ""
    if name.startswith(("jaxlib", "jax-cuda", "jax_cuda", "jax-triton")):
      out[name] = dist.version
  return out


def meta(argv) -> dict:
  dev = jax.devices()[0]
  return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              versions=_versions(), backend=jax.default_backend(), device=dev.device_kind,
              device_count=jax.device_count(), platform_version=dev.client.platform_version,
              host=platform.machine(), cpus=os.cpu_count(), argv=list(argv))


def _write(path, record):
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(tmp, path)


def parse_sections(text: str, sections: dict | None = None) -> list[Section]:
  sections = SECTIONS if sections is None else sections
  by_name = {s.name: s for s in sections.values()}
  chosen = []
  for item in (t.strip() for t in text.split(",") if t.strip()):
    found = sections.get(item) or by_name.get(item)
    if found is None:
      raise ValueError(f"--sections item {item!r}: expected one of "
                       f"{[f'{s.letter} ({s.name})' for s in sections.values()]}")
    if found not in chosen:
      chosen.append(found)
  if not chosen:
    raise ValueError(f"--sections={text!r}: expected at least one section")
  return chosen


@dataclasses.dataclass(frozen=True)
class Suite:
  """What differs between this GPU suite and its TPU twin (`tpu_suite.py`): the sections, the
  sizes, the engine shape, the kernel backend and the platform the full run needs."""
  name: str
  platform: str
  sections: dict
  full: Sizes
  smoke: Sizes
  full_engine: dict
  smoke_engine: dict
  backend: object
  smoke_backend: object
  doc: str
  full_step: dict = dataclasses.field(default_factory=lambda: FULL_STEP)
  smoke_step: dict = dataclasses.field(default_factory=lambda: SMOKE_STEP)


def gpu_suite() -> Suite:
  return Suite(name="gpu_suite", platform="gpu", sections=SECTIONS, full=FULL, smoke=SMOKE,
               full_engine=FULL_ENGINE, smoke_engine=SMOKE_ENGINE,
               backend=dispatch.Backend.PALLAS, smoke_backend=dispatch.Backend.PALLAS_INTERPRET,
               doc=__doc__)



def _token_counts(text: str) -> tuple[int, ...] | None:
  """'8192,16384' -> (8192, 16384); None unless every entry is a positive int."""
  try:
    counts = tuple(int(c) for c in text.split(","))
  except ValueError:
    return None
  return counts if counts and min(counts) > 0 else None

def main(argv=None, suite: Suite | None = None) -> int:
  suite = gpu_suite() if suite is None else suite
  argv = sys.argv[1:] if argv is None else list(argv)
  ap = argparse.ArgumentParser(description=suite.doc.split("\n")[0])
  ap.add_argument("--out", required=True, help="JSON file to write")
  ap.add_argument("--sections", default=None,
                  help="comma-separated section letters or names (default: all; without "
                       "--smoke all but those that need a call of their own, j)")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny shapes on CPU, kernels in interpret mode")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="time guard of the whole run in seconds (default 540; --smoke 3600: "
                       "the CPU's compilations take minutes under load)")
  ap.add_argument("--contexts", default=None,
                  help="section e's contexts in tokens, comma-separated, measured in this order "
                       "(default: the suite's, longest first)")
  ap.add_argument("--engine-batch", default=None,
                  help="sections e and i's sequences: a number, or 'pool' (what the model's "
                       "training preset's KV pool holds at each context; the full default)")
  ap.add_argument("--step-lengths", default=None,
                  help="section j's response lengths in tokens, comma-separated, measured in "
                       "this order (default: the suite's, shortest first)")
  ap.add_argument("--step-batch", type=int, default=None,
                  help="section j's rollouts per step (default: what the memory plan's KV "
                       "pool holds at the longest sequence)")
  args = ap.parse_args(argv)
  # Before jax starts a backend: this process allocates what it uses instead of 75% of the
  # GPU up front, so the jobs of the own-process sections get the device's memory; and it may
  # grow to 90% of the device (section e holds a ~60 GB KV pool at 32K tokens x 16, the
  # trainer's own default, experiments/train.py).
  for name, value in _SUITE_ENV.items():
    if name not in os.environ:
      os.environ[name] = value
      _SET_ENV.append(name)
  if args.sections is None:
    args.sections = ",".join(s.letter for s in suite.sections.values()
                             if args.smoke or not s.own_call)
  try:
    chosen = parse_sections(args.sections, suite.sections)
  except ValueError as e:
    print(f"{suite.name}: {e}", file=sys.stderr)
    return 2
  out_dir = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(out_dir):
    print(f"{suite.name}: --out={args.out!r}: directory {out_dir} does not exist",
          file=sys.stderr)
    return 2
  if args.budget_s is None:
    args.budget_s = 3600.0 if args.smoke else 540.0
  if not args.budget_s > 0:
    print(f"{suite.name}: --budget-s={args.budget_s}: expected > 0", file=sys.stderr)
    return 2
  engine = suite.smoke_engine if args.smoke else suite.full_engine
  if args.contexts is not None:
    contexts = _token_counts(args.contexts)
    if contexts is None:
      print(f"{suite.name}: --contexts={args.contexts!r}: expected positive token counts, "
            "comma-separated", file=sys.stderr)
      return 2
    engine = dict(engine, contexts=contexts)
  if args.engine_batch is not None:
    if args.engine_batch != "pool" and not (args.engine_batch.isdigit()
                                            and int(args.engine_batch) > 0):
      print(f"{suite.name}: --engine-batch={args.engine_batch!r}: expected a positive number "
            "of sequences or 'pool'", file=sys.stderr)
      return 2
    engine = dict(engine, batch=(args.engine_batch if args.engine_batch == "pool"
                                 else int(args.engine_batch)))
  step = suite.smoke_step if args.smoke else suite.full_step
  if args.step_lengths is not None:
    lengths = _token_counts(args.step_lengths)
    if lengths is None:
      print(f"{suite.name}: --step-lengths={args.step_lengths!r}: expected positive token "
            "counts, comma-separated", file=sys.stderr)
      return 2
    step = dict(step, lengths=lengths)
  if args.step_batch is not None:
    if args.step_batch < 1:
      print(f"{suite.name}: --step-batch={args.step_batch}: expected a positive number of "
            "rollouts", file=sys.stderr)
      return 2
    step = dict(step, batch=args.step_batch)
  if not args.smoke and jax.default_backend() != suite.platform:
    print(f"{suite.name}: the full suite needs a {suite.platform.upper()} (jax backend is "
          f"{jax.default_backend()!r}); use --smoke on CPU", file=sys.stderr)
    return 2

  # Sections that run a job in its own process first, while this one holds no device memory.
  chosen = sorted(chosen, key=lambda sec: not sec.own_process)
  run = Run(suite.smoke if args.smoke else suite.full, args.smoke, args.budget_s,
            backend=suite.smoke_backend if args.smoke else suite.backend,
            engine=engine, step=step)
  record = dict(meta=meta(argv), smoke=args.smoke, sections={})
  _write(args.out, record)
  t_start = time.monotonic()
  try:
    _run_sections(run, chosen, record, args.out, t_start)
  finally:
    run.close()
  print(f"wrote {args.out}")
  return 1 if any(e["status"] in ("failed", "error")
                  for e in record["sections"].values()) else 0


def _run_sections(run: Run, chosen: list, record: dict, out: str, t_start: float):
  """Every chosen section in turn inside its guard; `record` rewritten to `out` after each."""
  for sec in chosen:
    key = f"{sec.letter}_{sec.name}"
    run.start_section(sec.budget_s)
    t0 = time.monotonic()
    entry: dict = {}
    if time.monotonic() >= run.total_deadline:
      entry = dict(status="skipped", reason="run time guard (--budget-s) reached")
    else:
      try:
        entry = dict(status="ok", results=sec.run(run))
      except CheckFailed as e:
        entry = dict(status="failed", error=str(e))
      except Exception:  # noqa: BLE001  a section's crash is recorded; the others still run
        entry = dict(status="error", error=traceback.format_exc())
      if run.skipped:
        entry["skipped"] = list(run.skipped)
        if entry["status"] == "ok":
          entry["status"] = "partial"
    gc.collect()  # a failed section's frames (and the device buffers they hold) go now
    entry["wall_s"] = round(time.monotonic() - t0, 2)
    record["sections"][key] = entry
    record["wall_s"] = round(time.monotonic() - t_start, 2)
    _write(out, record)
    print(f"[{sec.letter}] {sec.name}: {entry['status']} ({entry['wall_s']} s)", flush=True)
    if entry["status"] in ("failed", "error"):
      print(entry["error"], file=sys.stderr)


if __name__ == "__main__":
  sys.exit(main())
