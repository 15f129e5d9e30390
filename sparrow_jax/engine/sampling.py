"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

Every row carries its own sampling parameters as traced arrays, so one compiled decode step
serves any mix of requests. The random key of the token that will sit at position p of request
r is `fold_in(PRNGKey(seed_r), p)`: a request samples the same tokens whichever slot it lands
in and whoever shares the batch with it.

Log-probs returned with each sampled token are under the *sampling* distribution (after
temperature, top-k and top-p); for greedy rows (temperature 0) they are under the model's
unmodified distribution (temperature 1), which is what a greedy evaluation wants to report.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparrow_jax.pallas_kernels.reference import MASK_VALUE


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """Per-request sampling settings (verl/vLLM names)."""

  temperature: float = 1.0  # 0 means greedy
  top_p: float = 1.0
  top_k: int = 0  # 0 means off
  max_new_tokens: int = 256
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  seed: int = 0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"SamplingParams.temperature={self.temperature}: expected >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p={self.top_p}: expected in (0, 1]")
    if self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k={self.top_k}: expected >= 0 (0 = off)")
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: expected >= 1")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def _filter_logits(logits, top_p, top_k):
  """Mask logits outside each row's top-k and top-p sets. `[B, V]`, `[B]`, `[B]`."""
  v = logits.shape[-1]
  sorted_desc = -jnp.sort(-logits, axis=-1)  # [B, V]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  cum = jnp.cumsum(probs, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
  keep = (cum - probs) < top_p[:, None]
  n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
  pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
  thresh = jnp.maximum(kth, pth)
  return jnp.where(logits >= thresh, logits, MASK_VALUE)


def sample_tokens(logits, seeds, positions, temperature, top_p, top_k):
  """Sample one token per row.

  Args:
    logits: float32 `[B, V]`.
    seeds: int32 `[B]` request seeds; positions: int32 `[B]` position the token will occupy.
    temperature, top_p: float32 `[B]`; top_k: int32 `[B]`.
  Returns:
    (tokens int32 `[B]`, logprobs float32 `[B]`).
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  needs_filter = jnp.any(((top_p < 1.0) | (top_k > 0)) & ~greedy)
  filtered = jax.lax.cond(needs_filter, lambda x: _filter_logits(x, top_p, top_k),
                          lambda x: x, scaled)
  def draw(x):  # Gumbel-max sample of every row (the noise is most of a CPU step's sampling)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seeds,
                                                                               positions)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (x.shape[-1],), jnp.float32))(keys)
    return jnp.argmax(x + gumbel, axis=-1).astype(jnp.int32)

  # All rows greedy: nothing to draw (the `where` below takes every row's argmax).
  sampled = jax.lax.cond(jnp.all(greedy), lambda x: jnp.zeros(x.shape[:-1], jnp.int32), draw,
                         filtered)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
  dist = jnp.where(greedy[:, None], logits, filtered)
  logp = jax.nn.log_softmax(dist, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def topk_logprobs(logits, k: int):
  """Top-k (ids, log-probs) of the unmodified distribution, `[B, k]` each (monitor input)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  vals, ids = jax.lax.top_k(logp, k)
  return ids.astype(jnp.int32), vals
