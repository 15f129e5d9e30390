"""`exact_top_k` is `lax.top_k`, and the recompute's top-k never sorts the vocabulary.

The two-stage top-k must return the same values and indices as `lax.top_k`, ties included
(ties go to the lower index). The compiled recompute of a sequence that fits one logits chunk
(the SmolLM2 preset's 128-token bucket) once sorted every vocabulary row in full: XLA merged
the chunk's slices into the top-k's sort and lost its TopK routine.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.rl import logprobs


@pytest.mark.parametrize("shape,k", [((3, 5, 49152), 20), ((4, 151936), 20), ((7, 1000), 20),
                                     ((2, 3000), 5), ((6, 700), 20), ((5, 64), 8)])
@pytest.mark.parametrize("values", ["normal", "rounded", "mostly_equal"])
def test_exact_top_k_equals_lax_top_k(shape, k, values):
  rng = np.random.default_rng(sum(shape) + k)
  x = rng.standard_normal(shape)
  if values == "rounded":  # many ties
    x = np.round(x, 1)
  elif values == "mostly_equal":  # ties across blocks at the k-th value
    x = np.zeros(shape)
    x[..., 5::97] = 1.0
  x = jnp.asarray(x, jnp.float32)
  want = jax.lax.top_k(x, k)
  got = jax.jit(lambda x: logprobs.exact_top_k(x, k))(x)
  assert got[1].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def _vocab_sorts(hlo: str, vocab: int) -> list[str]:
  return [line.strip()[:160] for line in hlo.splitlines()
          if " sort(" in line and re.search(rf"\[[\d,]*\b{vocab}\]", line.split("sort(")[0])]


def test_recompute_of_one_chunk_does_not_sort_the_vocabulary(monkeypatch):
  vocab = 8192
  cfg = get_config("tiny", vocab_size=vocab)
  model = init_model(cfg)
  tokens = jnp.zeros((2, 64), jnp.int32)
  lengths = jnp.asarray([64, 40], jnp.int32)

  def hlo():
    fn = lambda tok, n: logprobs.token_logprobs(model, tok, lengths=n, chunk=128, topk=8)
    return jax.jit(fn).lower(tokens, lengths).compile().as_text()

  assert _vocab_sorts(hlo(), vocab) == []
  # The direct lax.top_k in the same place does sort whole rows (the check can fail).
  monkeypatch.setattr(logprobs, "exact_top_k", lambda x, k: jax.lax.top_k(x, k))
  assert _vocab_sorts(hlo(), vocab)


def test_top_k_stats_match_a_full_log_softmax():
  cfg = get_config("tiny", vocab_size=2048)
  model = init_model(cfg, seed=3)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 2048, (2, 20)), jnp.int32)
  st = logprobs.token_logprobs(model, tokens, chunk=8, topk=5)
  lp = jax.nn.log_softmax(model(tokens), axis=-1)  # [B, T, V]
  want_vals, want_ids = jax.lax.top_k(lp[:, :-1], 5)
  np.testing.assert_array_equal(np.asarray(st.topk_ids[:, 1:]), np.asarray(want_ids))
  np.testing.assert_allclose(np.asarray(st.topk_logp[:, 1:]), np.asarray(want_vals),
                             atol=1e-5)


def test_response_window_equals_the_full_stats_on_responses():
  """The LM head over each row's response window gives the full path's log-probs, entropy and
  top-k there (0 elsewhere), and the same gradient of a response-masked loss."""
  from flax import nnx
  cfg = get_config("tiny", vocab_size=1024, num_layers=1)
  graphdef, state = nnx.split(init_model(cfg, seed=5))
  rng = np.random.default_rng(1)
  b, t, width = 3, 24, 8
  tokens = jnp.asarray(rng.integers(0, 1024, (b, t)), jnp.int32)
  prompt = jnp.asarray([5, 16, 20], jnp.int32)  # the last row's window overhangs the row
  pos = np.arange(t)[None, :]
  resp = (pos >= np.asarray(prompt)[:, None]) & (pos < np.asarray(prompt)[:, None] + width)
  mask = jnp.asarray(resp, jnp.float32)

  def stats(st, window):
    return logprobs.token_logprobs(nnx.merge(graphdef, st), tokens, chunk=8, topk=4,
                                   with_entropy=True, window=window)

  def both(st, prompt):  # one program: one compile
    grad = lambda w: jax.grad(lambda s: jnp.sum(stats(s, w).logp * mask))(st)
    return stats(st, None), stats(st, (prompt, width)), grad(None), grad((prompt, width))

  full, win, g_full, g_win = jax.jit(both)(state, prompt)
  for name in ("logp", "entropy", "topk_ids", "topk_logp"):
    f, w = np.asarray(getattr(full, name)), np.asarray(getattr(win, name))
    m = resp if f.ndim == 2 else resp[..., None]
    np.testing.assert_allclose(np.where(m, f, 0), w, atol=1e-5, err_msg=name)
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-5), g_full, g_win)
