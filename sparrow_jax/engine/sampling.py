"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

Every row carries its own sampling parameters as traced arrays, so one compiled decode step
serves any mix of requests. The random key of the token that will sit at position p of request
r is `fold_in(key(seed_r), p)`, where `key(seed)` is the threefry key whose two 32-bit words
are the seed's high and low halves (`jax.random.PRNGKey(seed)` for seeds below 2**32): a
request samples the same tokens whichever slot it lands in and whoever shares the batch with it.

Filter order (transformers' `TemperatureLogitsWarper` -> `TopKLogitsWarper` ->
`TopPLogitsWarper`, and vLLM's `apply_top_k_top_p`): the logits are divided by the temperature,
the top-k set is kept, and the nucleus is taken over the *renormalised* top-k set: the
smallest set of the largest tokens whose top-k-renormalised mass reaches top_p (probabilities
.5/.3/.1/.1, k=2, p=0.6 keep {0}: .5/.8 = .625 >= .6). A token whose value ties the last kept
one is kept too (the references break such ties by sort position; random logits never tie).

Cost: `max_top_k` (static, the largest top_k of the rows; 0 when none sets one) bounds the
top-k work. Rows that set top_k are served by `lax.top_k(x, max_top_k)`, which returns their
candidates sorted, so the nucleus of a row with both costs a cumsum over `max_top_k` values;
only a row with top_p < 1 and no top_k makes the step sort the whole vocabulary.

Log-probs returned with each sampled token are under the *sampling* distribution (after
temperature, top-k and top-p); for greedy rows (temperature 0) they are under the model's
unmodified distribution (temperature 1), which is what a greedy evaluation wants to report.
The top-k log-probs kept for the monitor (`topk_logprobs`) are under the row's temperature as
well (T = 1 for greedy rows), before the top-k / top-p filter.

Request seeds of a training run come from `request_seed`, a fold-in hierarchy
(run seed -> step -> round -> prompt -> sample), so no two requests of a run share a seed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.pallas_kernels.reference import MASK_VALUE

SEED_LIMIT = 1 << 64  # request seeds are 64-bit: the two words of a threefry key


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """Per-request sampling settings (verl/vLLM names)."""

  temperature: float = 1.0  # 0 means greedy
  top_p: float = 1.0
  top_k: int = 0  # 0 means off
  max_new_tokens: int = 256
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  seed: int = 0  # in [0, 2**64): see `request_seed`

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"SamplingParams.temperature={self.temperature}: expected >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p={self.top_p}: expected in (0, 1]")
    if self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k={self.top_k}: expected >= 0 (0 = off)")
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: expected >= 1")
    if not (isinstance(self.seed, (int, np.integer)) and not isinstance(self.seed, bool)
            and 0 <= self.seed < SEED_LIMIT):
      raise ValueError(f"SamplingParams.seed={self.seed!r}: expected an int in [0, 2**64)")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


# --- request seeds --------------------------------------------------------------------------
_M64 = np.uint64((1 << 64) - 1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd: x -> parent + GOLDEN * (x + 1) is injective


def _mix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finaliser, a bijection of 64-bit words (uint64 arithmetic wraps)."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _fold_in(parent: np.ndarray, data: np.ndarray) -> np.ndarray:
  """Child key `data` of `parent`: distinct `data` under one parent give distinct children
  (an injective affine map followed by a bijection); keys of different parents are
  pseudo-random 64-bit words."""
  return _mix64(parent + _GOLDEN * (data + np.uint64(1)))


def request_seed(run_seed, step, round_, prompt, sample):
  """Seed of one request of a training run: run seed -> step -> round -> prompt -> sample,
  one fold-in per level.

  Two requests of a run that differ only in their last differing level (two samples of a
  prompt, two prompts of a round, ...) never share a seed; requests under different parents
  collide with probability 2**-64 per pair. The linear formula it replaces
  (`seed * 1_000_003 + step * 9_176 + prompt * G + sample`) repeated across steps once
  prompts x G exceeded 9,176.

  Args: `run_seed` any int (taken modulo 2**64); `step`, `round_`, `prompt`, `sample`
  non-negative ints or integer arrays (broadcast together).
  Returns: an int in [0, 2**64) (a uint64 array for array arguments): `SamplingParams.seed`.
  """
  if isinstance(run_seed, bool) or not isinstance(run_seed, (int, np.integer)):
    raise ValueError(f"request_seed: run_seed={run_seed!r}: expected an int")
  levels = {"step": step, "round_": round_, "prompt": prompt, "sample": sample}
  arrays = {}
  for name, v in levels.items():
    a = np.asarray(v)
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer) or (a < 0).any():
      raise ValueError(f"request_seed: {name}={v!r}: expected non-negative integer(s)")
    arrays[name] = a.astype(np.uint64)
  with np.errstate(over="ignore"):  # uint64 arithmetic is meant to wrap
    key = _mix64(np.asarray(int(run_seed) % SEED_LIMIT, np.uint64))
    for a in arrays.values():
      key = _fold_in(key, a)
  scalar = all(np.ndim(v) == 0 for v in levels.values())
  return int(key) if scalar else key


def seed_key_data(seeds) -> np.ndarray:
  """uint32 `[n, 2]` threefry key words (high, low) of 64-bit request seeds `[n]`."""
  s = np.asarray(seeds, np.uint64).reshape(-1)
  return np.stack([(s >> np.uint64(32)).astype(np.uint32),
                   (s & np.uint64(0xFFFFFFFF)).astype(np.uint32)], axis=-1)


# --- filters --------------------------------------------------------------------------------
def _keep_threshold(vals, k, top_p):
  """Smallest kept value of each row from its candidates sorted in descending order.

  vals: float32 `[B, N]` (descending); k: int32 `[B]` top-k (N for no top-k); top_p `[B]`.
  The nucleus is the references' rule on the renormalised top-k set: a token is dropped when
  the mass of it and of every smaller candidate is <= 1 - top_p (the largest is kept)."""
  n = vals.shape[-1]
  in_k = jnp.arange(n)[None, :] < k[:, None]  # [B, N]
  masked = jnp.where(in_k, vals, MASK_VALUE)
  probs = jax.nn.softmax(masked, axis=-1)  # renormalised over the top-k set
  tail = jnp.flip(jnp.cumsum(jnp.flip(probs, -1), axis=-1), -1)  # mass at or below each rank
  keep = in_k & ((tail > (1.0 - top_p)[:, None]) | (top_p >= 1.0)[:, None])
  keep = keep.at[:, 0].set(True)
  return jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1, keepdims=True)  # [B, 1]


def filter_branch(top_p, top_k, sampled):
  """Which filter a step runs (traced): 0 none, 1 top-k candidates only, 2 a full sort (a
  sampled row with top_p < 1 and no top_k)."""
  any_k = jnp.any(sampled & (top_k > 0))
  full = jnp.any(sampled & (top_p < 1.0) & (top_k <= 0))
  return jnp.where(full, 2, jnp.where(any_k | jnp.any(sampled & (top_p < 1.0)), 1, 0))


def filter_logits(x, top_p, top_k, sampled, max_top_k: int):
  """Mask every logit outside its row's top-k / top-p set with MASK_VALUE.

  x: float32 `[B, V]` tempered logits; top_p float32 `[B]`; top_k int32 `[B]` (0: off, at
  most `max_top_k`); sampled bool `[B]` (greedy rows are left alone). Every branch gives a
  row the same mask: a row with top_k is always filtered from its `max_top_k` largest values
  (from `lax.top_k` or the first columns of the full sort, the same numbers), so a row's
  tokens do not depend on which rows share its batch."""
  v = x.shape[-1]
  kcap = min(int(max_top_k), v)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v).astype(jnp.int32)  # [B]
  p = jnp.where(sampled, top_p, 1.0)

  def none(x):
    return x

  def from_topk(x):  # every filtered row has top_k > 0: its candidates are the kcap largest
    vals = jax.lax.top_k(x, kcap)[0]  # [B, kcap] descending
    kk = jnp.where(top_k > 0, jnp.minimum(k, kcap), kcap)
    thresh = _keep_threshold(vals, kk, p)
    active = sampled & ((top_k > 0) | (p < 1.0))
    return jnp.where(~active[:, None] | (x >= thresh), x, MASK_VALUE)

  def full_sort(x):
    vals = -jnp.sort(-x, axis=-1)  # [B, V] descending
    thresh = _keep_threshold(vals, k, p)
    if kcap:  # rows with top_k: the same computation as `from_topk`, on the same values
      kk = jnp.minimum(k, kcap)
      thresh = jnp.where((top_k > 0)[:, None], _keep_threshold(vals[:, :kcap], kk, p), thresh)
    active = sampled & ((top_k > 0) | (p < 1.0))
    return jnp.where(~active[:, None] | (x >= thresh), x, MASK_VALUE)

  branches = [none, from_topk if kcap else full_sort, full_sort]
  return jax.lax.switch(filter_branch(p, top_k, sampled), branches, x)


def row_argmax(x):
  """`jnp.argmax(x, axis=-1)` as int32, the same indices (the first maximum; a row holding NaN
  gives its first NaN), computed as a max and a min over indices: two plain reductions that
  XLA:CPU vectorises, where argmax's (value, index) pair reduce runs element by element (3x
  slower on [16, 49152]; with the Gumbel noise fused in, a sampled draw 14.5 -> 4.3 ms)."""
  nan = jnp.isnan(x)
  m = jnp.max(x, axis=-1, keepdims=True)  # (XLA:CPU's max may skip NaN: tested apart)
  hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == m)
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(hit, idx, jnp.int32(x.shape[-1] - 1)), axis=-1)


def sample_tokens(logits, seeds, positions, temperature, top_p, top_k, *, max_top_k: int = 0):
  """Sample one token per row.

  Args:
    logits: float32 `[B, V]`.
    seeds: uint32 `[B, 2]` key words of the request seeds (`seed_key_data`); positions:
      int32 `[B]` position the token will occupy.
    temperature, top_p: float32 `[B]`; top_k: int32 `[B]`, each <= `max_top_k` (static).
  Returns:
    (tokens int32 `[B]`, logprobs float32 `[B]`).
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  filtered = filter_logits(scaled, top_p, top_k, ~greedy, max_top_k)

  def draw(x):  # Gumbel-max sample of every row (the noise is most of a CPU step's sampling)
    keys = jax.vmap(jax.random.fold_in)(seeds, positions)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (x.shape[-1],), jnp.float32))(keys)
    return row_argmax(x + gumbel)

  # All rows greedy: nothing to draw (the `where` below takes every row's argmax).
  sampled = jax.lax.cond(jnp.all(greedy), lambda x: jnp.zeros(x.shape[:-1], jnp.int32), draw,
                         filtered)
  tokens = jnp.where(greedy, row_argmax(logits), sampled)
  dist = jnp.where(greedy[:, None], logits, filtered)
  logp = jax.nn.log_softmax(dist, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def topk_logprobs(logits, k: int, temperature=None):
  """Top-k (ids, log-probs), `[B, k]` each, of softmax(logits / T) per row: the temperature T
  the row samples at (`temperature` float32 `[B]`; greedy rows, T <= 0, and `None` use T = 1),
  before any top-k / top-p filter. The ids are those of the raw logits (a temperature keeps
  the order); the log-probs are of the distribution the token was drawn from, which the
  trainer's dense side (softmax(logits / T)) is compared with (monitor input, DeepConf)."""
  logits = logits.astype(jnp.float32)
  if temperature is not None:
    logits = logits / jnp.where(temperature <= 0, 1.0, temperature)[:, None]
  logp = jax.nn.log_softmax(logits, axis=-1)
  vals, ids = jax.lax.top_k(logp, k)
  return ids.astype(jnp.int32), vals
