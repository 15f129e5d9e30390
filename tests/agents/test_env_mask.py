"""Environment tokens (loss mask 0 inside a response) reach none of the learner's terms:
changing an environment token's log-probs (current, old, reference, rollout, entropy, top-k)
changes neither the GRPO loss nor its gradient, the KL and entropy terms, any rollout
correction, the monitor's alpha statistics, the ladder probe's tail, the IS stats, or
DistillSparse's loss and LoRA gradient. The batch keeps the mask from the completion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.engine.config import Completion
from sparrow_jax.models.lora import LoRAConfig, init_lora
from sparrow_jax.rl import distill, grpo
from sparrow_jax.rl.monitor import MismatchMonitor, MonitorConfig
from sparrow_jax.rl.switching import alpha_tail, alpha_tails_per_bin
from sparrow_jax.run.batch import make_batch
from sparrow_jax.run.hooks import rollout_is_stats
from sparrow_jax.schedule.presets import as_schedule
from sparrow_jax.schedule.schedule import teacher_forced_budgets
from tests.rl.sparse_setup import sharp_tiny, sparse_spec

B, T, P = 4, 40, 8


def _mask():
  """Prompt [0, P), then policy / environment / policy / environment / policy spans."""
  m = np.zeros((B, T), np.float32)
  m[:, P:] = 1
  m[:, 14:20] = 0  # the first tool response
  m[1:, 27:31] = 0  # a second one on rows 1-3
  m[3, 36:] = 0  # row 3 ends early (padding)
  return m


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.normal(size=s).astype(np.float32)
  logp = -np.abs(f(B, T)) - 0.1
  return dict(logp=logp, old=logp + 0.1 * f(B, T), ref=logp + 0.2 * f(B, T),
              rollout=logp + 0.3 * f(B, T), entropy=np.abs(f(B, T)),
              adv=f(B))


def _env_changed(x, m, value):
  env = (m == 0)
  env[:, :P] = False  # prompt positions are masked anyway; change only the env spans
  return np.where(env, value, x).astype(np.float32)


CONFIGS = [
    dict(),
    dict(kl_coef=0.1, entropy_coeff=0.01),
    dict(kl_coef=0.1, kl_kind="k2", agg="seq-mean-token-mean"),
    dict(agg="seq-mean-token-sum-norm", norm_len=64),
    dict(tis_cap=2.0),
    dict(tis_mask_threshold=1.5),
    dict(rollout_is="token", rollout_is_threshold="0.5_2.0"),
    dict(rollout_is="sequence", rollout_is_batch_normalize=True),
    dict(rollout_is="geometric", rollout_rs="seq_mean_k3,token", rollout_rs_threshold="0.5,3"),
    dict(rollout_rs="seq_max_k2", rollout_rs_threshold="0.5"),
    dict(rollout_token_veto_threshold=0.2),
    dict(rollout_mode="bypass", rollout_rs="token", rollout_rs_threshold="2"),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(kw) or "default")
def test_grpo_loss_kl_entropy_corrections_ignore_environment_tokens(kw):
  cfg = grpo.GRPOLossConfig(**kw)
  m = _mask()
  x = _inputs()
  bypass = cfg.rollout_bypass

  def run(d):
    old = d["rollout"] if bypass else d["old"]
    den = grpo.mini_batch_denominators(jnp.asarray(m), cfg, old_logp=jnp.asarray(old),
                                       rollout_logp=jnp.asarray(d["rollout"]))

    def f(logp, ent):
      return grpo.grpo_loss(logp, jnp.asarray(old), jnp.asarray(d["adv"]), jnp.asarray(m), cfg,
                            ref_logp=jnp.asarray(d["ref"]), rollout_logp=jnp.asarray(d["rollout"]),
                            entropy=ent, **den)
    (loss, met), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        jnp.asarray(d["logp"]), jnp.asarray(d["entropy"]))
    return loss, met, grads, den

  base = run(x)
  for value in (-30.0, 0.0, -1e-3):  # far below, at and near the policy's log-probs
    y = dict(x, **{k: _env_changed(x[k], m, value) for k in
                   ("logp", "old", "ref", "rollout")},
             entropy=_env_changed(x["entropy"], m, 7.0))
    got = run(y)
    np.testing.assert_allclose(got[0], base[0], rtol=1e-6, err_msg=str(kw))
    for k in base[1]:
      np.testing.assert_allclose(got[1][k], base[1][k], rtol=1e-5, atol=1e-7, err_msg=k)
    for g0, g1 in zip(base[2], got[2]):
      np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-8)
      assert not np.any(np.asarray(g1)[(m == 0)])  # no gradient reaches an env token
    for k in base[3]:
      np.testing.assert_allclose(got[3][k], base[3][k], rtol=1e-6)
  assert float(base[1]["num_tokens"]) <= m.sum()


def test_monitor_probe_and_is_stats_ignore_environment_tokens():
  m = _mask()
  rng = np.random.default_rng(1)
  k, V = 4, 50

  def topk():
    ids = np.stack([rng.permutation(V)[:k] for _ in range(B * T)]).reshape(B, T, k)
    lp = np.sort(np.log(rng.dirichlet(np.ones(V), (B, T)))[..., :k], -1)[..., ::-1]
    return ids.astype(np.int32), lp.astype(np.float32)

  s_ids, s_lp = topk()
  d_ids, d_lp = topk()
  cfg = MonitorConfig(tau=0.5, bin_size=8, min_count=1)
  base = MismatchMonitor(cfg).update(s_ids, s_lp, d_ids, d_lp, m)
  env = (m == 0)
  env[:, :P] = False
  s_lp2 = np.where(env[..., None], -0.01, s_lp).astype(np.float32)
  d_ids2 = np.where(env[..., None], 0, d_ids).astype(np.int32)
  d_lp2 = np.where(env[..., None], -20.0, d_lp).astype(np.float32)
  got = MismatchMonitor(cfg).update(s_ids, s_lp2, d_ids2, d_lp2, m)
  assert got.keys() == base.keys() and got == base
  # the ladder probe's tail and exact alpha's per-bin tails
  alpha = rng.uniform(0.5, 1, (B, T))
  alpha2 = np.where(env, 0.0, alpha)
  assert alpha_tail(alpha2, m, bin_size=8) == alpha_tail(alpha, m, bin_size=8)
  assert alpha_tails_per_bin(alpha2, m, bin_size=8) == alpha_tails_per_bin(alpha, m, bin_size=8)
  x = _inputs(2)
  assert (rollout_is_stats(_env_changed(x["old"], m, 0.0), _env_changed(x["rollout"], m, -40.0),
                           m) == rollout_is_stats(x["old"], x["rollout"], m))


@pytest.fixture(scope="module")
def tiny():
  return sharp_tiny()


@pytest.mark.parametrize("pg_coef", [0.0, 0.5])
def test_distill_sparse_ignores_environment_tokens(tiny, pg_coef):
  cfg, graphdef, state = tiny
  b, t = 2, 64
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, t)), jnp.int32)
  m = np.zeros((b, t), np.float32)
  m[:, 16:] = 1
  m[:, 30:40] = 0  # a tool response
  lora = init_lora(cfg, LoRAConfig(rank=4), jax.random.key(1))
  lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), lora)
  dense = distill.dense_logits_of(graphdef, state, tokens)
  old = np.asarray(distill.logprobs_from_logits(dense, tokens))
  roll = old + 0.1 * rng.normal(size=old.shape).astype(np.float32)
  adv = np.asarray([1.0, -0.5], np.float32)

  def run(old_lp, roll_lp):
    f = lambda lo: distill.distill_loss(
        lo, graphdef, state, tokens, jnp.asarray(m), jnp.asarray(old_lp),
        attention=sparse_spec(1), budgets=teacher_forced_budgets(as_schedule(1), t, b),
        prompt_lengths=jnp.full((b,), 16, jnp.int32), pg_coef=pg_coef,
        advantages=jnp.asarray(adv), rollout_logp=jnp.asarray(roll_lp))
    return jax.value_and_grad(f, has_aux=True)(lora)

  (l0, m0), g0 = run(old, roll)
  env = np.zeros_like(m, bool)
  env[:, 30:40] = True
  (l1, m1), g1 = run(np.where(env, -25.0, old), np.where(env, 0.0, roll))
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for k in m0:
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-7, err_msg=k)
  for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-8)
  assert float(m0["num_tokens"]) == m[:, 1:].sum()


def test_make_batch_keeps_the_environment_mask():
  mask = np.asarray([1, 1, 0, 0, 0, 1, 1], np.float32)
  c = Completion(request_id=(0, 0), prompt_ids=np.asarray([5, 6, 7], np.int32),
                 token_ids=np.arange(10, 17, dtype=np.int32),
                 logprobs=np.where(mask > 0, -0.5, 0.0).astype(np.float32),
                 finish_reason="stop", loss_mask=mask)
  plain = Completion(request_id=(0, 1), prompt_ids=np.asarray([5, 6, 7], np.int32),
                     token_ids=np.arange(10, 14, dtype=np.int32),
                     logprobs=np.full(4, -0.5, np.float32), finish_reason="stop")
  b = make_batch([c, plain], max_new_tokens=8, topk=2)
  assert b.mask[0].tolist() == [0, 0, 0] + mask.tolist()
  assert b.mask[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]
