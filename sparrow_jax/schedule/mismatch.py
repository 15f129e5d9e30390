"""Actor–policy mismatch metrics: per-token acceptance rate, tail statistics, Beta tail fit.

Paper §3.1: the acceptance rate of token t between the dense policy p and the sparse actor q is
  alpha_t = sum_v min(p_t(v), q_t(v))  (= 1 − total-variation distance(p_t, q_t)),
and what matters for stability is its tail: the 5th percentile ("p5") of alpha_t over all tokens
whose position falls in a bin (2K tokens by default). Names here carry these symbols:

  acceptance_rate             exact alpha_t from dense logits p and sparse logits q, [..., T, V]
                              -> [..., T]; jax, jittable, chunked so that vocab-sized float32
                              temporaries stay under `chunk_bytes`.
  acceptance_rate_numpy       the same on the host in float64 (reference and small arrays).
  topk_logprobs               per-token top-k (token ids, log-probs) of one distribution; the
                              rollout and the dense recompute store these (`log_probs_to_keep`,
                              k = 20 in the release).
  topk_acceptance_lower_bound Sparrow's online statistic: sum of min(p, q) over the tokens in
                              both top-k sets; tokens outside a set count as probability 0, so
                              it is <= alpha_t, with equality when the sets cover both supports.
  bin_stats                   per-bin count, mean, p1, p5, p10, p50 and fraction alpha >= 0.999.
  alpha_position_correlation  Pearson r of alpha_t against position over all tokens (paper:
                              about −0.1 for raw alpha).
  binned_p5_correlation       Pearson r of per-bin p5 against bin centre (paper: about −0.55).
  fit_beta_tail               Beta(a, b) MLE of the tail (alpha < 0.999, rescaled to [0, 1) by
                              dividing by 0.999) with its Kolmogorov–Smirnov statistic (paper:
                              KS < 0.04 for Qwen3-1.7B).

"Position" is the number of tokens held in the KV cache for the query whose logits produced
alpha_t (see `schedule.py`), so per-bin statistics line up with schedule bins.
Logits are those the tokens are sampled from (apply any temperature before calling).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

DEFAULT_CHUNK_BYTES = 256 * 2**20  # vocab-sized temporaries per chunk
ACCEPT_THRESHOLD = 0.999  # "perfectly aligned" tokens (paper §3.1)
_TEMPS_PER_ROW = 6  # float32 [V] temporaries per row: 2 casts, 2 log-softmax, min, exp


def rows_per_chunk(vocab_size: int, chunk_bytes: int, *, itemsize: int = 4,
                   temps_per_row: int = _TEMPS_PER_ROW) -> int:
  """Rows (tokens) per chunk so that temps_per_row * rows * V * itemsize <= chunk_bytes."""
  if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
    raise ValueError(f"chunk_bytes={chunk_bytes!r}: expected a positive int (bytes)")
  return max(1, chunk_bytes // (temps_per_row * vocab_size * itemsize))


def _check_pair(p, q, name_p="p_logits", name_q="q_logits"):
  if p.shape != q.shape:
    raise ValueError(f"{name_q}.shape={q.shape}: expected the same shape as "
                     f"{name_p}.shape={p.shape}")
  if p.ndim < 2:
    raise ValueError(f"{name_p}.shape={p.shape}: expected [..., T, V] (at least 2 dims)")


def _check_mask(mask, shape, name="mask"):
  if mask is not None and tuple(mask.shape) != tuple(shape):
    raise ValueError(f"{name}.shape={tuple(mask.shape)}: expected {tuple(shape)} (the token "
                     "axes of the inputs)")


def _chunked_rows(fn, arrays, rows_chunk: int):
  """Apply fn to row-chunks of [R, ...] arrays with lax.map; returns outputs of shape [R, ...]."""
  r = arrays[0].shape[0]
  n = -(-r // rows_chunk)
  pad = n * rows_chunk - r
  xs = tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(
      (n, rows_chunk) + a.shape[1:]) for a in arrays)  # each [n, rows_chunk, ...]
  if n == 1:
    out = jax.tree.map(lambda o: o[None], fn(*(x[0] for x in xs)))
  else:
    out = jax.lax.map(lambda c: fn(*c), xs)
  return jax.tree.map(lambda o: o.reshape((n * rows_chunk,) + o.shape[2:])[:r], out)


def acceptance_rate(p_logits, q_logits, mask=None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    fill_value: float = 0.0, dtype=jnp.float32) -> jnp.ndarray:
  """Exact alpha_t = sum_v min(softmax(p)_v, softmax(q)_v); jittable, chunked over tokens.

  Args:
    p_logits: [..., T, V] dense-policy logits (any float dtype).
    q_logits: [..., T, V] sparse-actor logits.
    mask: optional [..., T] bool; masked-out tokens get `fill_value`.
    chunk_bytes: bound on the vocab-sized temporaries of one chunk (static).
    dtype: accumulation dtype, float32 (default) or float64 (needs jax x64 enabled).
  Returns:
    [..., T] alpha in [0, 1] (dtype).
  """
  p_logits, q_logits = jnp.asarray(p_logits), jnp.asarray(q_logits)
  _check_pair(p_logits, q_logits)
  _check_mask(mask, p_logits.shape[:-1])
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
    raise ValueError(f"dtype={dtype}: expected float32 or float64")
  if dtype == jnp.float64 and not jax.config.jax_enable_x64:
    raise ValueError("dtype=float64: expected jax_enable_x64 to be set (jax would silently "
                     "compute in float32)")
  lead, v = p_logits.shape[:-1], p_logits.shape[-1]
  p2 = p_logits.reshape(-1, v)  # [R, V]
  q2 = q_logits.reshape(-1, v)

  def chunk(pc, qc):  # [rows, V] -> [rows]
    lp = jax.nn.log_softmax(pc.astype(dtype), axis=-1)
    lq = jax.nn.log_softmax(qc.astype(dtype), axis=-1)
    return jnp.sum(jnp.exp(jnp.minimum(lp, lq)), axis=-1)

  rows = rows_per_chunk(v, chunk_bytes, itemsize=dtype.itemsize)
  alpha = _chunked_rows(chunk, (p2, q2), min(rows, max(p2.shape[0], 1))).reshape(lead)  # [..., T]
  alpha = jnp.clip(alpha, 0.0, 1.0)
  if mask is not None:
    alpha = jnp.where(jnp.asarray(mask, bool), alpha, jnp.asarray(fill_value, dtype))
  return alpha


def _log_softmax_np(x: np.ndarray) -> np.ndarray:
  m = x.max(axis=-1, keepdims=True)
  z = x - m
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def acceptance_rate_numpy(p_logits, q_logits, mask=None, *,
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                          fill_value: float = 0.0) -> np.ndarray:
  """Host float64 alpha_t, chunked like `acceptance_rate`: [..., T, V] x2 -> [..., T]."""
  p, q = np.asarray(p_logits), np.asarray(q_logits)
  _check_pair(p, q)
  _check_mask(mask, p.shape[:-1])
  v = p.shape[-1]
  p2, q2 = p.reshape(-1, v), q.reshape(-1, v)  # [R, V]
  rows = rows_per_chunk(v, chunk_bytes, itemsize=8)
  out = np.empty(p2.shape[0], np.float64)
  for s in range(0, p2.shape[0], rows):
    lp = _log_softmax_np(p2[s:s + rows].astype(np.float64))
    lq = _log_softmax_np(q2[s:s + rows].astype(np.float64))
    out[s:s + rows] = np.exp(np.minimum(lp, lq)).sum(-1)
  out = np.clip(out, 0.0, 1.0).reshape(p.shape[:-1])
  if mask is not None:
    out = np.where(np.asarray(mask, bool), out, fill_value)
  return out


def topk_logprobs(logits, k: int = 20, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
  """Per-token top-k (ids, log-probs) of softmax(logits); jittable, chunked over tokens.

  Args:
    logits: [..., T, V].
    k: entries kept per token (the release's `log_probs_to_keep`, 20); static.
  Returns:
    ids [..., T, k] int32 and logprobs [..., T, k] float32, sorted by decreasing log-prob.
  """
  logits = jnp.asarray(logits)
  if logits.ndim < 2:
    raise ValueError(f"logits.shape={logits.shape}: expected [..., T, V] (at least 2 dims)")
  v = logits.shape[-1]
  if not isinstance(k, int) or not 1 <= k <= v:
    raise ValueError(f"k={k!r}: expected an int in [1, vocab_size={v}]")
  lead = logits.shape[:-1]
  x = logits.reshape(-1, v)  # [R, V]

  def chunk(xc):  # [rows, V] -> ([rows, k], [rows, k])
    lp = jax.nn.log_softmax(xc.astype(jnp.float32), axis=-1)
    vals, ids = jax.lax.top_k(lp, k)
    return ids.astype(jnp.int32), vals

  rows = rows_per_chunk(v, chunk_bytes, temps_per_row=3)
  ids, vals = _chunked_rows(chunk, (x,), min(rows, max(x.shape[0], 1)))
  return ids.reshape(lead + (k,)), vals.reshape(lead + (k,))


def topk_acceptance_lower_bound(p_ids, p_logprobs, q_ids, q_logprobs, mask=None, *,
                                fill_value: float = 0.0) -> jnp.ndarray:
  """Lower bound of alpha_t from two top-k sets: sum over shared ids of min(p, q).

  Args:
    p_ids, p_logprobs: [..., T, kp] dense top-k (ids unique per token; ids < 0 = padding).
    q_ids, q_logprobs: [..., T, kq] sparse top-k.
    mask: optional [..., T] bool; masked-out tokens get `fill_value`.
  Returns:
    [..., T] float32, <= the exact alpha_t; equal when each set covers its distribution's
    support.
  """
  p_ids, q_ids = jnp.asarray(p_ids), jnp.asarray(q_ids)
  p_lp = jnp.asarray(p_logprobs, jnp.float32)
  q_lp = jnp.asarray(q_logprobs, jnp.float32)
  if p_ids.shape != p_lp.shape or q_ids.shape != q_lp.shape:
    raise ValueError(f"top-k shapes: p_ids {p_ids.shape} vs p_logprobs {p_lp.shape}, q_ids "
                     f"{q_ids.shape} vs q_logprobs {q_lp.shape}: expected ids and log-probs "
                     "of equal shape")
  if p_ids.shape[:-1] != q_ids.shape[:-1] or p_ids.ndim < 1:
    raise ValueError(f"q_ids.shape={q_ids.shape}: expected the same token axes as "
                     f"p_ids.shape={p_ids.shape} ([..., T, k])")
  _check_mask(mask, p_ids.shape[:-1])
  same = (p_ids[..., :, None] == q_ids[..., None, :]) & (p_ids[..., :, None] >= 0)  # [..., kp, kq]
  both = jnp.exp(jnp.minimum(p_lp[..., :, None], q_lp[..., None, :]))  # [..., kp, kq]
  bound = jnp.clip(jnp.sum(jnp.where(same, both, 0.0), axis=(-2, -1)), 0.0, 1.0)  # [..., T]
  if mask is not None:
    bound = jnp.where(jnp.asarray(mask, bool), bound, jnp.float32(fill_value))
  return bound


# --- host-side statistics (numpy / scipy, float64) ------------------------------------------

def _flat_valid(alpha, positions=None, mask=None):
  a = np.asarray(alpha, np.float64)
  if positions is not None:
    pos = np.asarray(positions)
    if pos.shape != a.shape:
      raise ValueError(f"positions.shape={pos.shape}: expected alpha.shape={a.shape}")
    if pos.size and pos.min() < 0:
      raise ValueError(f"positions min={pos.min()}: expected >= 0 (tokens held in the cache)")
  if mask is not None:
    m = np.asarray(mask, bool)
    if m.shape != a.shape:
      raise ValueError(f"mask.shape={m.shape}: expected alpha.shape={a.shape}")
  else:
    m = np.ones(a.shape, bool)
  a = a[m]
  return (a, None) if positions is None else (a, np.asarray(positions)[m].astype(np.int64))


@dataclasses.dataclass(frozen=True)
class BinStats:
  """Per-bin statistics of alpha_t; arrays are [num_bins]; empty bins have NaN statistics."""

  bin_size: int
  start: np.ndarray  # int64 first position of the bin
  centre: np.ndarray  # float64 start + bin_size / 2
  count: np.ndarray  # int64 tokens in the bin
  mean: np.ndarray
  p1: np.ndarray
  p5: np.ndarray
  p10: np.ndarray
  p50: np.ndarray
  frac_accepted: np.ndarray  # share of tokens with alpha >= 0.999

  @property
  def num_bins(self) -> int:
    return int(self.count.shape[0])

  def rows(self) -> list[dict]:
    """One dict per bin (for CSV/JSON/printing)."""
    keys = ("start", "centre", "count", "mean", "p1", "p5", "p10", "p50", "frac_accepted")
    return [{"bin": i, **{k: getattr(self, k)[i].item() for k in keys}}
            for i in range(self.num_bins)]


def bin_stats(alpha, positions, mask=None, *, bin_size: int = 2000, num_bins: int | None = None,
              accept_threshold: float = ACCEPT_THRESHOLD) -> BinStats:
  """Per position bin: count, mean, p1, p5, p10, p50, share alpha >= accept_threshold.

  Bin = position // bin_size; with `num_bins`, longer positions join the last bin (as in a
  schedule, whose last bin extends to infinity); without it, enough bins to hold the largest
  position. Percentiles are numpy's default (linear interpolation).
  """
  if not isinstance(bin_size, (int, np.integer)) or bin_size <= 0:
    raise ValueError(f"bin_size={bin_size!r}: expected a positive int (tokens)")
  a, pos = _flat_valid(alpha, positions, mask)
  bins = pos // bin_size
  if num_bins is None:
    num_bins = int(bins.max()) + 1 if bins.size else 1
  elif not isinstance(num_bins, (int, np.integer)) or num_bins <= 0:
    raise ValueError(f"num_bins={num_bins!r}: expected a positive int")
  bins = np.minimum(bins, num_bins - 1)
  stats = {k: np.full(num_bins, np.nan) for k in ("mean", "p1", "p5", "p10", "p50", "frac")}
  count = np.bincount(bins, minlength=num_bins).astype(np.int64)
  for b in np.nonzero(count)[0]:
    x = a[bins == b]
    stats["mean"][b] = x.mean()
    stats["p1"][b], stats["p5"][b], stats["p10"][b], stats["p50"][b] = np.percentile(
        x, [1, 5, 10, 50])
    stats["frac"][b] = np.mean(x >= accept_threshold)
  start = np.arange(num_bins, dtype=np.int64) * bin_size
  return BinStats(bin_size=int(bin_size), start=start, centre=start + bin_size / 2.0,
                  count=count, mean=stats["mean"], p1=stats["p1"], p5=stats["p5"],
                  p10=stats["p10"], p50=stats["p50"], frac_accepted=stats["frac"])


def pearson_r(x, y) -> float:
  """Pearson correlation in float64; NaN when fewer than 2 points or a constant input."""
  x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
  if x.shape != y.shape:
    raise ValueError(f"pearson_r: x has {x.size} values, y has {y.size}: expected equal")
  if x.size < 2:
    return float("nan")
  dx, dy = x - x.mean(), y - y.mean()
  den = np.sqrt((dx * dx).sum() * (dy * dy).sum())
  return float((dx * dy).sum() / den) if den > 0 else float("nan")


def alpha_position_correlation(alpha, positions, mask=None) -> float:
  """Pearson r of alpha_t against position over all (unmasked) tokens."""
  a, pos = _flat_valid(alpha, positions, mask)
  return pearson_r(a, pos)


def binned_p5_correlation(stats: BinStats, *, min_count: int = 1) -> float:
  """Pearson r of per-bin p5 against bin centre, over bins with >= min_count tokens."""
  keep = stats.count >= min_count
  return pearson_r(stats.p5[keep], stats.centre[keep])


@dataclasses.dataclass(frozen=True)
class BetaTailFit:
  """Beta(a, b) fitted to the rescaled tail x = alpha / threshold of tokens alpha < threshold."""

  a: float
  b: float
  n_tail: int  # tokens in the tail (before any subsampling)
  tail_fraction: float  # n_tail / tokens considered
  ks_statistic: float  # sup |ECDF(x) - BetaCDF(x)|
  ks_pvalue: float  # optimistic: the parameters were fitted to the same data
  threshold: float

  @property
  def mean(self) -> float:
    """Mean of the fitted Beta on the rescaled [0, 1] axis."""
    return self.a / (self.a + self.b)

  @property
  def variance(self) -> float:
    """Variance of the fitted Beta on the rescaled [0, 1] axis."""
    s = self.a + self.b
    return self.a * self.b / (s * s * (s + 1.0))


def fit_beta_tail(alpha, mask=None, *, threshold: float = ACCEPT_THRESHOLD,
                  max_samples: int | None = 200_000, seed: int = 0,
                  eps: float = 1e-6) -> BetaTailFit:
  """MLE Beta fit (scipy `beta.fit`, floc=0, fscale=1) of the tail and its KS statistic.

  Tail = tokens with alpha < threshold, rescaled to [0, 1) by dividing by threshold and clipped
  to [eps, 1 - eps] (the Beta log-density is infinite at 0 and 1). With more than
  `max_samples` tail tokens a seeded random subset is fitted (the KS test uses the same subset).
  """
  if not 0.0 < threshold <= 1.0:
    raise ValueError(f"threshold={threshold!r}: expected a float in (0, 1]")
  a, _ = _flat_valid(alpha, None, mask)
  tail = a[a < threshold]
  if tail.size < 2:
    raise ValueError(f"fit_beta_tail: {tail.size} token(s) with alpha < threshold={threshold}: "
                     "expected at least 2 to fit a Beta")
  x = np.clip(tail / threshold, eps, 1.0 - eps)
  if max_samples is not None and x.size > max_samples:
    x = np.random.default_rng(seed).choice(x, size=max_samples, replace=False)
  ba, bb, _, _ = scipy.stats.beta.fit(x, floc=0.0, fscale=1.0)
  ks = scipy.stats.kstest(x, "beta", args=(ba, bb, 0.0, 1.0))
  return BetaTailFit(a=float(ba), b=float(bb), n_tail=int(tail.size),
                     tail_fraction=float(tail.size / a.size), ks_statistic=float(ks.statistic),
                     ks_pvalue=float(ks.pvalue), threshold=float(threshold))


def mismatch_summary(alpha, positions, mask=None, *, bin_size: int = 2000,
                     num_bins: int | None = None) -> dict:
  """The §3.1 numbers in one dict: share >= 0.999, mean, Pearson r (raw and binned p5),
  per-bin rows and the Beta tail fit (None when the tail has fewer than 2 tokens)."""
  a, _ = _flat_valid(alpha, positions, mask)
  stats = bin_stats(alpha, positions, mask, bin_size=bin_size, num_bins=num_bins)
  try:
    beta = dataclasses.asdict(fit_beta_tail(alpha, mask))
  except ValueError:
    beta = None
  return {
      "tokens": int(a.size),
      "frac_accepted": float(np.mean(a >= ACCEPT_THRESHOLD)) if a.size else float("nan"),
      "mean": float(a.mean()) if a.size else float("nan"),
      "p5": float(np.percentile(a, 5)) if a.size else float("nan"),
      "pearson_alpha_position": alpha_position_correlation(alpha, positions, mask),
      "pearson_p5_bin_centre": binned_p5_correlation(stats),
      "bins": stats.rows(),
      "beta_tail": beta,
  }
