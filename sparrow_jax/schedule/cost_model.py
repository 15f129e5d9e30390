"""Cost model of dense vs block-sparse decode: eFLOPs, bytes moved, roofline time, speedup.

Paper §3.3 prices generation in "eFLOPs". Per generated token at cache length n (the number
of tokens held, the new one included; see `schedule.py` for "position"):

  dense   F_d(n) = 2·P + r·D·N·n
  sparse  F_s(n) = 2·P + r·D·(N_d·n + N_s·m(n)) + N_s·(c_lm·D + c_top·Kv)·s(n)

with the symbols
  P      matmul parameters: q/k/v/o projections and the SwiGLU MLP of every layer, plus the LM
         head (vocab × hidden) unless `include_lm_head=False`. Norm weights, biases, RoPE,
         softmax and the embedding lookup are left out (O(hidden) per token).
  N      layers; N_d of them dense (the schedule's `dense_layers`, 0 and 1 in the release),
         N_s = N − N_d block-sparse.
  D      KV width = kv_heads · head_dim (`ModelConfig.kv_width`), Kv = kv_heads.
  r      = 4·G with G = heads / kv_heads (the GQA group): each of the G query heads sharing a
         KV head does QK^T (2·head_dim FLOPs per key) and PV (2·head_dim per value), so one
         layer costs 4·H·head_dim·n = 4·G·D·n. The paper's closed form
         C = 2PN·L_out + r'(2L_in + L_out)·L_out·N·D is this sum over t with r' = r/2.
  m(n)   tokens attended by a sparse layer: pages attended A = budget(n) + reserved (1 bos +
         2 recent in the release, the partial newest page among them). If the sequence holds
         no more than A pages attention is dense (m = n, nothing scored); otherwise the
         held − A pages skipped are all full and m(n) = n − (held − A)·page_size.
  s(n)   pages scored = full pages held (n // page_size), only when selection is active.
  c_lm   landmark scoring FLOPs per page and channel: 2 for "mean" (dot of the group-mean query
         with the centroid), 4 for "quest" (two products, a max, an add). The group mean of the
         queries (H·head_dim adds per layer) is left out.
  c_top  top-k selection cost per candidate page per KV head (`topk_ops_per_candidate`,
         default 1; the paper only says "plus top-k").

Bytes moved per decode step of a batch of B sequences at the same length:
  weights   bpe · (all non-embedding parameters + the LM head matrix), read once per step and
            shared by the whole batch (for a tied model the LM head is the embedding matrix);
  KV read   bpe · 2·D·(N_d·n + N_s·m(n)) per sequence (K and V of every token attended);
  landmarks lbpe · D·s(n)·N_s per sequence (×2 for quest: min and max), lbpe the bytes of the
            landmark dtype the cache keeps (`landmark_bytes_per_element`: 4 for the default
            float32 landmarks, 2 with `landmark_dtype=bfloat16`); at 32K tokens with a 2K-token
            budget float32 landmarks cost as many bytes as the selected K and V;
  KV write  bpe · 2·D·N per sequence (the new token). Landmark writes (1/page_size of that),
            activations and page tables are left out.

Roofline time of a step = max(B·F / peak_flops, bytes / mem_bandwidth) on a `GPUSpec`
(H200 defaults: 4.8e12 B/s, 989e12 FLOP/s dense bf16, 2 bytes per weight / KV element,
4 per landmark element). A rollout sums
the steps t = 0..L_gen−1 at n = L_in + t + 1 plus one dense prefill of the prompt (Sparrow
keeps prefill dense, so it is the same for both); every sequence runs to L_gen (no early
stops), so this prices the longest trajectory of a batch, not an average one.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from typing import Mapping, Sequence

import numpy as np

from sparrow_jax.models.config import ModelConfig
from sparrow_jax.schedule import schedule as sched_lib
from sparrow_jax.schedule.schedule import SparsitySchedule

_LANDMARK_FLOPS = {"mean": 2, "quest": 4}  # c_lm: FLOPs per page per channel
_LANDMARK_VECTORS = {"mean": 1, "quest": 2}  # head_dim vectors stored per page per KV head


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPUSpec:
  """Roofline of one accelerator (defaults: one NVIDIA H200, dense bf16)."""

  name: str = "H200"
  mem_bandwidth: float = 4.8e12  # bytes / s
  peak_flops: float = 989e12  # FLOP / s
  bytes_per_element: int = 2  # weights and KV cache
  landmark_bytes_per_element: int = 4  # float32 landmarks (2: landmark_dtype=bfloat16)

  def __post_init__(self):
    for f in ("mem_bandwidth", "peak_flops"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"GPUSpec.{f}={v!r}: expected a positive number")
    for f in ("bytes_per_element", "landmark_bytes_per_element"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"GPUSpec.{f}={v!r}: expected a positive int")


def matmul_params(cfg: ModelConfig, *, include_lm_head: bool = True) -> int:
  """P: weights used in matmuls per token (attention projections + MLP [+ LM head])."""
  h, d = cfg.hidden_size, cfg.head_dim
  per_layer = h * d * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * d * h
  per_layer += 3 * h * cfg.intermediate_size
  p = cfg.num_layers * per_layer
  return p + (cfg.vocab_size * h if include_lm_head else 0)


def weight_bytes(cfg: ModelConfig, gpu: GPUSpec, *, include_lm_head: bool = True) -> int:
  """Bytes of weights read per decode step: non-embedding parameters [+ LM head matrix]."""
  n = cfg.num_params(include_embeddings=False)
  return gpu.bytes_per_element * (n + (cfg.vocab_size * cfg.hidden_size if include_lm_head
                                       else 0))


def attention_r(cfg: ModelConfig) -> int:
  """r in r·D·N·n: 4 · (query heads per KV head)."""
  return 4 * cfg.group_size


def _layer_split(cfg: ModelConfig, schedule: SparsitySchedule) -> tuple[int, int]:
  """(N_d, N_s): dense and block-sparse layer counts under `schedule`."""
  if schedule.is_dense:
    return cfg.num_layers, 0
  n_d = sum(1 for l in schedule.dense_layers if l < cfg.num_layers)
  return n_d, cfg.num_layers - n_d


def per_token_cost(cfg: ModelConfig, schedule: SparsitySchedule, positions, *,
                   gpu: GPUSpec = GPUSpec(), include_lm_head: bool = True,
                   topk_ops_per_candidate: float = 1.0) -> dict[str, np.ndarray]:
  """Per-sequence cost of decoding one token at each cache length n in `positions` ([L]).

  Returns float64 arrays [L]: tokens_attended (m(n) of a sparse layer), pages_scored (s(n)),
  flops_linear, flops_attention, flops_landmark, flops_topk, flops (their sum), kv_read_bytes,
  landmark_bytes, kv_write_bytes, bytes (their sum; weights excluded, see `step_cost`).
  """
  n = np.asarray(positions, dtype=np.int64)  # [L]
  if n.size and n.min() < 1:
    raise ValueError(f"positions min={n.min()}: expected >= 1 (tokens held, the new one "
                     "included)")
  s = schedule.page_size
  n_d, n_s = _layer_split(cfg, schedule)
  d_kv, kv = cfg.kv_width, cfg.num_kv_heads
  held = -(-n // s)  # [L]
  if schedule.is_dense:
    active = np.zeros(n.shape, bool)
    attended = held
  else:
    attended = np.asarray(sched_lib.pages_attended(schedule, n), np.int64)  # [L]
    active = held > attended
  m = np.where(active, n - (held - attended) * s, n)  # [L] tokens per sparse layer
  scored = np.where(active, n // s, 0)  # [L]
  r = attention_r(cfg)
  bpe = gpu.bytes_per_element
  f_lin = np.full(n.shape, 2.0 * matmul_params(cfg, include_lm_head=include_lm_head))
  f_att = r * d_kv * (n_d * n + n_s * m).astype(np.float64)
  f_lm = float(_LANDMARK_FLOPS[schedule.landmark] * d_kv * n_s) * scored
  f_top = float(topk_ops_per_candidate * kv * n_s) * scored
  kv_read = bpe * 2.0 * d_kv * (n_d * n + n_s * m)
  lbpe = gpu.landmark_bytes_per_element
  lm_read = float(lbpe * _LANDMARK_VECTORS[schedule.landmark] * d_kv * n_s) * scored
  kv_write = np.full(n.shape, float(bpe * 2 * d_kv * cfg.num_layers))
  return {
      "tokens_attended": m.astype(np.float64), "pages_scored": scored.astype(np.float64),
      "flops_linear": f_lin, "flops_attention": f_att, "flops_landmark": f_lm,
      "flops_topk": f_top, "flops": f_lin + f_att + f_lm + f_top,
      "kv_read_bytes": kv_read, "landmark_bytes": lm_read, "kv_write_bytes": kv_write,
      "bytes": kv_read + lm_read + kv_write,
  }


@dataclasses.dataclass(frozen=True)
class RolloutCost:
  """Totals for a batch of sequences decoded from L_in to L_in + L_gen (float64)."""

  schedule: str
  batch: int
  prompt_len: int
  gen_len: int
  flops: float  # decode eFLOPs over the batch (prefill excluded)
  flops_by_part: dict  # linear / attention / landmark / topk
  bytes: float  # decode bytes over all steps (weights counted once per step)
  bytes_by_part: dict  # weights / kv_read / landmarks / kv_write
  decode_time_s: float  # roofline, summed over steps
  prefill_time_s: float
  memory_bound_steps: float  # fraction of decode steps limited by bandwidth

  @property
  def time_s(self) -> float:
    return self.decode_time_s + self.prefill_time_s

  @property
  def tokens_per_s(self) -> float:
    return self.batch * self.gen_len / self.time_s

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(time_s=self.time_s, tokens_per_s=self.tokens_per_s)
    return d


def _check_lengths(prompt_len, gen_len, batch):
  for f, v, lo in (("prompt_len", prompt_len, 0), ("gen_len", gen_len, 1), ("batch", batch, 1)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
      raise ValueError(f"{f}={v!r}: expected an int >= {lo}")


def prefill_cost(cfg: ModelConfig, prompt_len: int, batch: int, *, gpu: GPUSpec = GPUSpec(),
                 include_lm_head: bool = True) -> tuple[float, float, float]:
  """(flops, bytes, roofline seconds) of one dense causal prefill of the batch's prompts."""
  if prompt_len == 0:
    return 0.0, 0.0, 0.0
  lp = prompt_len
  flops = batch * (2.0 * matmul_params(cfg, include_lm_head=include_lm_head) * lp
                   + attention_r(cfg) * cfg.kv_width * cfg.num_layers * lp * (lp + 1) / 2.0)
  nbytes = (weight_bytes(cfg, gpu, include_lm_head=include_lm_head)
            + batch * gpu.bytes_per_element * 2.0 * cfg.kv_width * cfg.num_layers * lp)
  return flops, nbytes, max(flops / gpu.peak_flops, nbytes / gpu.mem_bandwidth)


def rollout_cost(cfg: ModelConfig, schedule: SparsitySchedule, *, prompt_len: int,
                 gen_len: int, batch: int, gpu: GPUSpec = GPUSpec(),
                 include_lm_head: bool = True, topk_ops_per_candidate: float = 1.0,
                 include_prefill: bool = True) -> RolloutCost:
  """Sum of roofline step costs for t = 0..gen_len−1 at n = prompt_len + t + 1."""
  _check_lengths(prompt_len, gen_len, batch)
  n = prompt_len + 1 + np.arange(gen_len, dtype=np.int64)  # [L_gen]
  c = per_token_cost(cfg, schedule, n, gpu=gpu, include_lm_head=include_lm_head,
                     topk_ops_per_candidate=topk_ops_per_candidate)
  w = float(weight_bytes(cfg, gpu, include_lm_head=include_lm_head))
  step_flops = batch * c["flops"]  # [L_gen]
  step_bytes = w + batch * c["bytes"]  # [L_gen]
  t_flops = step_flops / gpu.peak_flops
  t_bytes = step_bytes / gpu.mem_bandwidth
  step_time = np.maximum(t_flops, t_bytes)
  if include_prefill:
    _, _, t_pre = prefill_cost(cfg, prompt_len, batch, gpu=gpu, include_lm_head=include_lm_head)
  else:
    t_pre = 0.0
  parts = ("linear", "attention", "landmark", "topk")
  return RolloutCost(
      schedule=schedule.name, batch=int(batch), prompt_len=int(prompt_len), gen_len=int(gen_len),
      flops=float(step_flops.sum()),
      flops_by_part={p: float(batch * c[f"flops_{p}"].sum()) for p in parts},
      bytes=float(step_bytes.sum()),
      bytes_by_part={"weights": w * gen_len, "kv_read": float(batch * c["kv_read_bytes"].sum()),
                     "landmarks": float(batch * c["landmark_bytes"].sum()),
                     "kv_write": float(batch * c["kv_write_bytes"].sum())},
      decode_time_s=float(step_time.sum()), prefill_time_s=float(t_pre),
      memory_bound_steps=float(np.mean(t_bytes >= t_flops)))


def rollout_speedup(cfg: ModelConfig, schedule: SparsitySchedule, *, prompt_len: int,
                    gen_len: int, batch: int, gpu: GPUSpec = GPUSpec(), **kw) -> dict:
  """Dense vs `schedule`: roofline time speedup, eFLOP ratio and byte ratio (decode)."""
  dense = rollout_cost(cfg, dense_schedule_like(schedule), prompt_len=prompt_len,
                       gen_len=gen_len, batch=batch, gpu=gpu, **kw)
  sparse = rollout_cost(cfg, schedule, prompt_len=prompt_len, gen_len=gen_len, batch=batch,
                        gpu=gpu, **kw)
  return {"time_speedup": dense.time_s / sparse.time_s,
          "eflops_ratio": dense.flops / sparse.flops,
          "bytes_ratio": dense.bytes / sparse.bytes,
          "dense": dense, "sparse": sparse}


def dense_schedule_like(schedule: SparsitySchedule) -> SparsitySchedule:
  """The dense baseline with the same page size (pages only matter for sparse layers)."""
  return SparsitySchedule(name="dense", page_size=schedule.page_size, bin_size=schedule.bin_size,
                          budgets=(), reserved_bos=0, reserved_recent=0, dense_layers=(),
                          tau=None, is_dense=True)


# --- page-size comparison from an alpha table -------------------------------------------------

AlphaTable = Mapping[tuple[int, int, int], float]  # (page_size, bin, budget pages) -> p5


def load_alpha_table(source: str | os.PathLike | AlphaTable) -> dict[tuple[int, int, int], float]:
  """p5 alpha per (page_size, bin index, budget pages) from a dict or a CSV with header
  `page_size,bin,budget,p5` (extra columns are ignored)."""
  if isinstance(source, Mapping):
    out = {}
    for k, v in source.items():
      if not (isinstance(k, tuple) and len(k) == 3):
        raise ValueError(f"alpha table key {k!r}: expected (page_size, bin, budget)")
      out[tuple(int(x) for x in k)] = float(v)
    return out
  p = os.fspath(source)
  if not os.path.isfile(p):
    raise ValueError(f"alpha table file {p!r} does not exist")
  out = {}
  with open(p, newline="") as f:
    reader = csv.DictReader(f)
    need = {"page_size", "bin", "budget", "p5"}
    if reader.fieldnames is None or not need <= set(reader.fieldnames):
      raise ValueError(f"alpha table file {p!r}: header {reader.fieldnames}: expected columns "
                       f"{sorted(need)}")
    for i, row in enumerate(reader, start=2):
      try:
        key = (int(row["page_size"]), int(row["bin"]), int(row["budget"]))
        out[key] = float(row["p5"]) if row["p5"] not in ("", "nan", "NaN") else float("nan")
      except (TypeError, ValueError):
        raise ValueError(f"alpha table file {p!r} line {i}: {row}: expected integer "
                         "page_size/bin/budget and a float p5") from None
  return out


def compare_page_sizes(cfg: ModelConfig, table: AlphaTable, *, tau: float, bin_size: int,
                       prompt_len: int, gen_len: int, batch: int, gpu: GPUSpec = GPUSpec(),
                       page_sizes: Sequence[int] = (16, 32, 64, 128),
                       base: SparsitySchedule | None = None, **kw) -> list[dict]:
  """For each page size in the table: the tau schedule it allows and its predicted speedup.

  Per page size the schedule takes, per bin, the smallest budget with p5 >= tau (made
  non-decreasing, `schedule.schedule_from_p5`); reserved pages, dense layers and landmark come
  from `base` (release defaults if None). Page sizes absent from the table are skipped.
  """
  table = load_alpha_table(table)
  base = base or SparsitySchedule(budgets=(1,))
  rows = []
  for ps in page_sizes:
    keys = [k for k in table if k[0] == ps]
    if not keys:
      continue
    bins = sorted({k[1] for k in keys})
    budgets = sorted({k[2] for k in keys})
    p5 = np.full((bins[-1] + 1, len(budgets)), np.nan)
    for (_, b, k) in keys:
      p5[b, budgets.index(k)] = table[(ps, b, k)]
    sched, feasible = sched_lib.schedule_from_p5(
        p5, budgets, tau=tau, bin_size=bin_size, page_size=ps, name=f"page{ps}-tau{tau}",
        reserved_bos=base.reserved_bos, reserved_recent=base.reserved_recent,
        dense_layers=base.dense_layers, landmark=base.landmark)
    sp = rollout_speedup(cfg, sched, prompt_len=prompt_len, gen_len=gen_len, batch=batch,
                         gpu=gpu, **kw)
    rows.append({"page_size": ps, "budgets": list(sched.budgets),
                 "tokens_max": (max(sched.budgets) + sched.reserved) * ps,
                 "all_bins_feasible": bool(feasible.all()),
                 "time_speedup": sp["time_speedup"], "eflops_ratio": sp["eflops_ratio"]})
  return rows
