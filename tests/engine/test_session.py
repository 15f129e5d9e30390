"""The engine's rollout session: requests added while others run, completions collected as they
finish, weights loaded between chunks with each token's policy version recorded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.engine.session import EngineSession
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model

CFG = get_config("tiny", eos_token_ids=())  # no EOS: lengths are deterministic
_PAD = 64


@pytest.fixture(scope="module")
def models():
  return init_model(CFG, seed=11), init_model(CFG, seed=12)


@jax.jit
def _forward(graphdef, state, toks):
  return nnx.merge(graphdef, state)(toks)


def _ref_logprobs(model, prompt, tokens) -> np.ndarray:
  """log softmax (T = 1) of a full forward of `model` at each generated token [n]."""
  seq = list(prompt) + list(tokens)
  padded = np.zeros((1, _PAD), np.int32)
  padded[0, :len(seq)] = seq
  logits = np.asarray(_forward(*nnx.split(model), jnp.asarray(padded)))[0, :len(seq)]
  rows = logits[len(prompt) - 1:-1].astype(np.float64)
  rows = rows - rows.max(-1, keepdims=True)
  lp = rows - np.log(np.exp(rows).sum(-1, keepdims=True))
  return np.take_along_axis(lp, np.asarray(tokens)[:, None], axis=1)[:, 0]


def _reqs(n, new, seed0=0):
  rng = np.random.default_rng(seed0)
  return [Request(list(rng.integers(3, CFG.vocab_size, int(rng.integers(4, 12)))),
                  SamplingParams(temperature=1.0, max_new_tokens=new, seed=seed0 * 100 + i),
                  (seed0, i)) for i in range(n)]


def _engine(model, **kw):
  cfg = dict(num_slots=2, max_seq_len=_PAD, decode_chunk=4)
  cfg.update(kw)
  return GenerationEngine(model, EngineConfig(**cfg))


def test_requests_added_while_others_run_match_generate(models):
  a, _ = models
  first, later = _reqs(3, 20, 0), _reqs(3, 13, 1)
  ref = _engine(a).generate(first + later)
  eng = _engine(a)
  sess = EngineSession(eng)
  sess.add(first)
  got = {}
  for _ in range(3):
    sess.step()
  assert sess.num_running > 0  # the later requests join a running engine
  rows = sess.add(later)
  assert len(rows) == 3
  while sess.has_work():
    sess.step()
    for c in sess.collect():  # copies: rows are reused by later adds
      got[c.request_id] = c
  for r, c in zip(first + later, ref):
    g = got[r.request_id]
    np.testing.assert_array_equal(g.token_ids, c.token_ids)
    np.testing.assert_allclose(g.logprobs, c.logprobs, atol=1e-6)
    assert (g.versions == 0).all() and len(g.versions) == len(g.token_ids)
  st = sess.stats()
  assert st["finished"] == 6 and st["generated_tokens"] == 3 * 20 + 3 * 13
  assert 0 < sess.occupancy <= 1
  # freed rows are reused: six requests never needed more than the rows they ran in
  assert sess.run.out.tokens.shape[0] <= 6


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_weight_update_mid_sequence_shows_in_versions_and_logprobs(models, mode):
  a, b = models
  reqs = _reqs(2, 24, 2)
  eng = _engine(a, overlap_chunks=True)
  sess = EngineSession(eng)
  sess.add(reqs)
  for _ in range(3):
    sess.step()
  assert sess.num_running == 2
  sess.update_weights(nnx.split(b)[1], version=7, on_running=mode)
  assert sess.version == 7 and sess.weight_updates == 1
  while sess.has_work():
    sess.step()
  outs = sorted(sess.collect(), key=lambda c: c.request_id)
  alone = _engine(a).generate(reqs)  # never updated
  for r, c, ref in zip(reqs, outs, alone):
    v = c.versions
    k = int(np.sum(v == 0))
    assert 0 < k < len(v) and (v[:k] == 0).all() and (v[k:] == 7).all(), v
    # before the update: the old weights' tokens, exactly as a run that never updated
    np.testing.assert_array_equal(c.token_ids[:k], ref.token_ids[:k])
    lp_a = _ref_logprobs(a, r.prompt_ids, c.token_ids)
    lp_b = _ref_logprobs(b, r.prompt_ids, c.token_ids)
    np.testing.assert_allclose(c.logprobs[:k], lp_a[:k], atol=1e-4)
    # after it: scored by the new weights (recompute: exactly B's forward; keep: B's weights
    # over the old KV, no longer A's log-probs)
    assert np.max(np.abs(c.logprobs[k:] - lp_a[k:])) > 1e-2
    if mode == "recompute":
      np.testing.assert_allclose(c.logprobs[k:], lp_b[k:], atol=1e-4)
  if mode == "recompute":
    assert sess.update_recomputes == 2 and sess.stats()["preemptions"] == 2


def test_drain_finishes_running_sequences_under_the_old_weights(models):
  a, b = models
  eng = _engine(a, num_slots=1)
  sess = EngineSession(eng)
  sess.add(_reqs(2, 12, 3))
  sess.step()
  sess.update_weights(nnx.split(b)[1], version=1, on_running="drain")
  assert sess.version == 0  # still the old weights: a sequence runs
  while sess.has_work():
    sess.step()
  first, second = sorted(sess.collect(), key=lambda c: c.request_id)
  assert (first.versions == 0).all() and (second.versions == 1).all()
  with pytest.raises(ValueError, match="on_running"):
    sess.update_weights(nnx.split(b)[1], version=2, on_running="pause")
