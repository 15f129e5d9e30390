"""Benchmark: dense vs block-sparse paged decode attention (one layer, one decode step).

Times, on whatever backend jax has (Pallas kernels on a GPU, XLA elsewhere):
  dense ref    `reference.dense_decode_reference`, the float32 reference (upcasts the gathered
               pages; the decoder's dense path before the fast path existed);
  dense xla    `paged_decode.dense_decode_xla`: the dense XLA path (cache dtype, float32
               accumulation; on CPU also a gather-free contiguous-cache einsum as a lower bound);
  dense kernel `paged_decode.paged_decode`, the dense Pallas kernel (GPU only);
  score        gather the pool landmarks through the page table + `score_pages`;
  top-k        `select_pages` (lax.top_k + reserved pages);
  attention    `dispatch.sparse_decode_attention` over the selected pages;
  sparse       score + top-k + attention in one jitted step (what decode runs),
for contexts 4K-32K and budgets 16-256 pages, batch 8, 16 query / 8 kv heads x 128
(Qwen3-1.7B-like), page size 16, bfloat16 cache on GPU / float32 on CPU. Medians over repeats;
prints a markdown table with the ratio sparse / dense, where dense is what
`dispatch.dense_decode_attention` runs on this backend (the kernel on a GPU, XLA elsewhere).

On a GPU it also prints the bandwidth the Pallas kernels achieve (bytes of the K/V pages they
read / time) against a measured device copy, and times jax's own
`jax.experimental.pallas.ops.gpu.paged_attention` on the dense case. The one-shot GPU report
(bandwidth at batch 64, 32K, several dense launch configs, one JSON) is `gpu_suite.py`.

  python benchmarks/decode_attention.py            # full table
  python benchmarks/decode_attention.py --quick    # small run (4K/8K, budgets 16/64)
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

from sparrow_jax.pallas_kernels import dispatch, landmarks, reference, selection  # noqa: E402
from sparrow_jax.pallas_kernels.paged_decode import PagedDecodeConfig  # noqa: E402
from sparrow_jax.pallas_kernels.sparse_decode import SparseDecodeConfig  # noqa: E402


def median_time(fn, *args, repeats: int) -> float:
  """Median wall time (seconds) of fn(*args), after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def make_case(rng, *, batch, heads, kv_heads, head_dim, page_size, context, dtype):
  """A full paged cache: every sequence holds `context - 5` tokens (a partial last page) in
  shuffled physical pages; page 0 is the null page."""
  m = context // page_size
  p = batch * m + 1
  key = jax.random.key(int(rng.integers(1 << 30)))
  kk, kv, kq = jax.random.split(key, 3)
  k_pages = jax.random.normal(kk, (kv_heads, p, page_size, head_dim), dtype)  # [K, P, S, D]
  v_pages = jax.random.normal(kv, (kv_heads, p, page_size, head_dim), dtype)
  q = jax.random.normal(kq, (batch, heads, head_dim), dtype)  # [B, H, D]
  table = jnp.asarray(1 + rng.permutation(batch * m).reshape(batch, m), jnp.int32)  # [B, M]
  lengths = jnp.full((batch,), context - 5, jnp.int32)
  lm = landmarks.compute_landmarks(k_pages, jnp.full((kv_heads, p), page_size), "mean")
  return q, k_pages, v_pages, table, lengths, lm


def device_copy_bandwidth(x, repeats):
  """Bytes moved (read + write) per second by a device copy of x."""
  copy = jax.jit(lambda a: a + jnp.zeros((), a.dtype))
  t = median_time(copy, x, repeats=repeats)
  return 2 * x.size * x.dtype.itemsize / t


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="contexts 4K/8K, budgets 16/64")
  ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 8192, 16384, 32768])
  ap.add_argument("--budgets", type=int, nargs="*", default=[16, 32, 64, 128, 256])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--backend", default="auto", choices=[b.value for b in dispatch.Backend])
  args = ap.parse_args(argv)
  if args.quick:
    args.contexts, args.budgets, args.repeats = [4096, 8192], [16, 64], 3

  backend = dispatch.resolve_backend(args.backend)
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  config = SparseDecodeConfig()
  s = args.page_size
  print(f"# decode attention: jax {jax.__version__}, device {jax.devices()[0].device_kind}, "
        f"backend {backend.value}, {jnp.dtype(dtype).name} cache, batch {args.batch}, "
        f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, page {s}, "
        f"median of {args.repeats}; times in ms")
  rng = np.random.default_rng(0)

  dense_ref_fn = jax.jit(reference.dense_decode_reference)
  dense_xla_fn = jax.jit(lambda *a: dispatch.dense_decode_attention(*a, backend="xla"))
  # The dense kernel only where it compiles (interpret mode would time the interpreter).
  with_kernel = backend is dispatch.Backend.PALLAS
  dense_kernel_fn = jax.jit(lambda *a: dispatch.dense_decode_attention(
      *a, backend=backend, config=PagedDecodeConfig()))

  @jax.jit
  def contiguous_dense(q, k, v):  # [B, H, D], [B, K, T, D]: no page gather (CPU lower bound)
    b, h, d = q.shape
    qg = q.reshape(b, k.shape[1], h // k.shape[1], d).astype(jnp.float32)
    logits = jnp.einsum("bkgd,bktd->bkgt", qg, k.astype(jnp.float32)) * d ** -0.5
    w = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkgt,bktd->bkgd", w, v.astype(jnp.float32)).reshape(b, h, d)

  def score_fn(q, lm, table):
    return landmarks.score_pages(q, landmarks.gather_landmarks(lm, table), "mean")

  score_fn = jax.jit(score_fn)

  rows = []
  header = ("| context | budget | dense ref | dense xla |"
            + (" dense kernel | dense GB/s |" if with_kernel else "")
            + " score | top-k | attention | sparse | sparse/dense |"
            + (" contiguous dense | sparse/contig |" if not on_gpu else
               " sparse GB/s | % of copy | jax paged_attention |"))
  print(header)
  print("|" + "---|" * (header.count("|") - 1))
  for context in args.contexts:
    case = make_case(rng, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                     head_dim=args.head_dim, page_size=s, context=context, dtype=dtype)
    q, k_pages, v_pages, table, lengths, lm = case
    dense_args = (q, k_pages, v_pages, table, lengths)
    t_ref = median_time(dense_ref_fn, *dense_args, repeats=args.repeats)
    t_xla = median_time(dense_xla_fn, *dense_args, repeats=args.repeats)
    dense_cols = f"{t_ref * 1e3:.3f} | {t_xla * 1e3:.3f} |"
    t_dense = t_xla
    if with_kernel:
      t_dense = median_time(dense_kernel_fn, *dense_args, repeats=args.repeats)
      own_pages = args.kv_heads * int(jnp.sum((lengths + s - 1) // s))
      dense_bytes = 2 * own_pages * s * args.head_dim * jnp.dtype(dtype).itemsize
      dense_cols += f" {t_dense * 1e3:.3f} | {dense_bytes / t_dense / 1e9:.1f} |"
    extra_dense = ""
    if on_gpu:
      from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
      m = table.shape[1]
      jpa = jax.jit(lambda *a: jax_paged.paged_attention(
          *a, k_splits=16 if m % 16 == 0 else 1))
      t_jax = median_time(jpa, q, k_pages, v_pages, table, lengths, repeats=args.repeats)
      copy_bw = device_copy_bandwidth(k_pages, args.repeats)
      extra_dense = f"{t_jax * 1e3:.3f}"
    else:
      k_cont = jnp.swapaxes(k_pages[:, table].reshape(args.kv_heads, args.batch, -1,
                                                      args.head_dim), 0, 1)
      v_cont = jnp.swapaxes(v_pages[:, table].reshape(args.kv_heads, args.batch, -1,
                                                      args.head_dim), 0, 1)
      t_contig = median_time(contiguous_dense, q, k_cont, v_cont, repeats=args.repeats)
      del k_cont, v_cont
    num_pages = (lengths + s - 1) // s
    for budget in args.budgets:
      # The kernel wants whole blocks per split; XLA gathers every slot, so no padding there.
      multiple = 1 if backend is dispatch.Backend.XLA else config.slot_multiple()
      sel_kw = dict(max_budget=budget, slot_multiple=multiple)
      budgets = jnp.full((args.batch,), budget, jnp.int32)
      topk_fn = jax.jit(lambda sc, n, bud, kw=sel_kw: selection.select_pages(sc, n, bud, **kw))

      def attn(q, k_pages, v_pages, table, lengths, page_idx, valid):
        return dispatch.sparse_decode_attention(q, k_pages, v_pages, table, lengths, page_idx,
                                                valid, backend=backend, config=config)

      attn_fn = jax.jit(attn)

      def step(q, k_pages, v_pages, table, lengths, lm, bud, kw=sel_kw):
        page_idx, valid = selection.select_decode_pages(q, lm, table, lengths, bud,
                                                        kind="mean", page_size=s, **kw)
        return attn(q, k_pages, v_pages, table, lengths, page_idx, valid)

      step_fn = jax.jit(step)
      scores = score_fn(q, lm, table)
      page_idx, valid = topk_fn(scores, num_pages, budgets)
      t_score = median_time(score_fn, q, lm, table, repeats=args.repeats)
      t_topk = median_time(topk_fn, scores, num_pages, budgets, repeats=args.repeats)
      t_attn = median_time(attn_fn, q, k_pages, v_pages, table, lengths, page_idx, valid,
                           repeats=args.repeats)
      t_sparse = median_time(step_fn, q, k_pages, v_pages, table, lengths, lm, budgets,
                             repeats=args.repeats)
      row = (f"| {context // 1024}K | {budget} | {dense_cols} {t_score * 1e3:.3f} | "
             f"{t_topk * 1e3:.3f} | {t_attn * 1e3:.3f} | {t_sparse * 1e3:.3f} | "
             f"{t_sparse / t_dense:.3f} |")
      if on_gpu:
        n_read = int(valid.sum())  # (sequence, kv head, page) triples attended
        kv_bytes = 2 * n_read * s * args.head_dim * jnp.dtype(dtype).itemsize
        bw = kv_bytes / t_attn
        row += f" {bw / 1e9:.1f} | {100 * bw / copy_bw:.0f}% | {extra_dense} |"
      else:
        row += f" {t_contig * 1e3:.3f} | {t_sparse / t_contig:.3f} |"
      print(row, flush=True)
      rows.append((context, budget, t_dense, t_sparse))
    del case, q, k_pages, v_pages, lm
  if on_gpu:
    print(f"# measured device copy bandwidth: {copy_bw / 1e9:.1f} GB/s (read + write)")
  print(f"# python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} cpus")
  return rows


if __name__ == "__main__":
  main()
