"""Schedule ladder: switch after M passing probe checks, streak reset, checkpoints, probes."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models.lora import LoRAConfig, init_lora
from sparrow_jax.rl.switching import (ScheduleLadder, attention_for, probe_alpha,
                                      probe_tail_alpha)
from sparrow_jax.schedule.presets import constant, dense, get_schedule
from tests.rl.sparse_setup import sharp_tiny, sparse_spec


def _ladder(patience=3, probe_every=2):
  return ScheduleLadder([get_schedule("qwen3-1.7b-0.86"), get_schedule("qwen3-1.7b-0.83"),
                         get_schedule("qwen3-1.7b-0.80")], tau=0.86, patience=patience,
                        probe_every=probe_every)


def test_switch_after_m_consecutive_checks_and_reset(caplog):
  lad = _ladder()
  assert lad.current.name == "qwen3-1.7b-0.86" and lad.candidate.name == "qwen3-1.7b-0.83"
  # Crosses tau twice, drops (streak reset), then holds for 3 checks: switch on the last one.
  tails = [0.87, 0.90, 0.80, 0.86, 0.88, 0.91]
  with caplog.at_level(logging.WARNING, logger="sparrow_jax.rl.switching"):
    switched = [lad.observe(a, step=10 * (i + 1)) for i, a in enumerate(tails)]
  assert switched == [False, False, False, False, False, True]
  assert lad.current.name == "qwen3-1.7b-0.83" and lad.candidate.name == "qwen3-1.7b-0.80"
  assert lad.streak == 0 and lad.checks == 6
  assert lad.history == [{"step": 60, "check": 6, "from": "qwen3-1.7b-0.86",
                          "to": "qwen3-1.7b-0.83", "tail": 0.91}]
  assert "qwen3-1.7b-0.86 -> qwen3-1.7b-0.83 at step 60" in caplog.text
  # Hovering just under tau, or passing only M - 1 times in a row, never switches.
  for a in [0.859, 0.9, 0.9, 0.85, 0.95, 0.95, 0.7, 0.9, 0.9]:
    assert not lad.observe(a)
  assert lad.current.name == "qwen3-1.7b-0.83" and lad.streak == 2
  assert lad.observe(0.9)  # the third in a row
  assert lad.candidate is None
  # At the top of the ladder nothing is probed or switched.
  assert not lad.observe(0.99) and not lad.should_probe(100)
  assert lad.metrics()["ladder/switches"] == 2.0


def test_should_probe_and_validation():
  lad = _ladder(probe_every=5)
  assert [s for s in range(0, 16) if lad.should_probe(s)] == [5, 10, 15]
  with pytest.raises(ValueError, match="patience=0"):
    ScheduleLadder([constant(4)], tau=0.86, patience=0)
  with pytest.raises(ValueError, match="tau=1.2"):
    ScheduleLadder([constant(4)], tau=1.2)
  with pytest.raises(ValueError, match="distinct names"):
    ScheduleLadder([constant(4), constant(4)], tau=0.86)
  with pytest.raises(ValueError, match="expected a SparsitySchedule"):
    ScheduleLadder(["qwen3-1.7b-0.86"], tau=0.86)
  with pytest.raises(ValueError, match="probe_tail_alpha=nan"):
    lad.observe(float("nan"))


def test_state_dict_round_trip():
  lad = _ladder()
  for a in [0.9, 0.9, 0.9, 0.88]:
    lad.observe(a, step=1)
  sd = json.loads(json.dumps(lad.state_dict()))  # checkpoints store it as JSON
  new = _ladder()
  new.load_state_dict(sd)
  assert (new.index, new.streak, new.checks, new.history) == (1, 1, 4, lad.history)
  # Both continue identically.
  for a in [0.9, 0.9]:
    assert new.observe(a) == lad.observe(a)
  assert new.state_dict() == lad.state_dict()
  other = ScheduleLadder([constant(4), constant(2)], tau=0.86)
  with pytest.raises(ValueError, match="expected this ladder's schedules"):
    other.load_state_dict(sd)


def test_ladder_driven_by_real_probes():
  """Probe tails from the sparse actor: a candidate that meets tau is switched to after M
  checks, one that does not (1 page of 6) never is."""
  cfg, graphdef, state = sharp_tiny()
  b, t, p = 2, 96, 16
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (b, t)), jnp.int32)
  mask = np.zeros((b, t))
  mask[:, p:] = 1
  lora = init_lora(cfg, LoRAConfig(rank=4), jax.random.key(0))
  spec = sparse_spec(max_budget=6)  # one compiled probe serves both schedules
  tight = constant(1).replace(name="tight", dense_layers=(0,))
  loose = constant(6).replace(name="loose", dense_layers=(0,))  # every page: dense in effect
  pl = jnp.full((b,), p, jnp.int32)
  tail_tight = probe_tail_alpha(graphdef, state, lora, tokens, mask, pl, tight, attention=spec)
  tail_loose = probe_tail_alpha(graphdef, state, lora, tokens, mask, pl, loose, attention=spec)
  print(f"\nprobe p5 alpha: tight (1 page) {tail_tight:.4f}, loose (all pages) {tail_loose:.4f}")
  assert tail_tight < 0.86 <= tail_loose
  assert tail_loose > 0.999
  up = ScheduleLadder([tight, loose], tau=0.86, patience=2)
  assert [up.observe(tail_loose) for _ in range(2)] == [False, True]
  assert up.current.name == "loose"
  stay = ScheduleLadder([loose, tight], tau=0.86, patience=2)
  assert not any(stay.observe(tail_tight) for _ in range(4))
  assert stay.current.name == "loose"
  # The alpha behind the tail: aligned with tokens, 0 at t = 0, in [0, 1].
  alpha = probe_alpha(graphdef, state, None, tokens, tight, attention=spec,
                      prompt_lengths=pl)
  assert alpha.shape == (b, t) and np.all(alpha[:, 0] == 0)
  assert np.all((alpha[:, 1:] > 0) & (alpha[:, 1:] <= 1 + 1e-6))
  # Queries inside the prompt attend densely: alpha of tokens 1..p is ~1.
  assert np.all(alpha[:, 1:p + 1] > 0.9999)
  # Per-bin tail: the minimum over bins is at most the overall tail's bin-wise worst case.
  per_bin = probe_tail_alpha(graphdef, state, lora, tokens, mask, pl, tight, attention=spec,
                             bin_size=32, min_count=8)
  assert per_bin <= np.percentile(alpha[:, p:][alpha[:, p:] > 0], 50)
  with pytest.raises(ValueError, match="max_budget 6"):
    probe_alpha(graphdef, state, lora, tokens, loose, attention=sparse_spec(max_budget=2))
  with pytest.raises(ValueError, match="is dense"):
    attention_for(dense(), t)
  spec_auto = attention_for(get_schedule("qwen3-1.7b-0.86"), 3999)  # bins 0-1 reachable
  assert spec_auto.max_budget == 61 and spec_auto.dense_layers == (0, 1)
  assert spec_auto.page_size == 16


def test_probe_alpha_in_time_chunks_matches_full_logits_at_temperature():
  """The probe's LM head runs `chunk` positions at a time (T = 40 is not a multiple of 16);
  it equals the float64 alpha of the full tempered logits, and a bin needs `min_count`
  tokens: when none has them the tail is NaN (the trainer skips the check)."""
  from flax import nnx
  from sparrow_jax.schedule import mismatch
  from sparrow_jax.schedule.schedule import teacher_forced_budgets
  cfg, graphdef, state = sharp_tiny()
  b, t, p, temp = 2, 40, 16, 0.7
  tokens = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (b, t)), jnp.int32)
  pl = jnp.full((b,), p, jnp.int32)
  spec = sparse_spec(max_budget=1)
  tight = constant(1).replace(name="tight", dense_layers=(0,))
  alpha = probe_alpha(graphdef, state, None, tokens, tight, attention=spec, prompt_lengths=pl,
                      temperature=temp, chunk=16)
  model = nnx.merge(graphdef, state)
  dense_logits = np.asarray(model(tokens), np.float64)
  sparse_logits = np.asarray(model(tokens, attention=spec, budgets=teacher_forced_budgets(
      tight, t, b), prompt_lengths=pl), np.float64)
  want = mismatch.acceptance_rate_numpy(dense_logits[:, :-1] / temp,
                                        sparse_logits[:, :-1] / temp)
  np.testing.assert_allclose(alpha[:, 1:], want, atol=2e-5)
  assert np.all(alpha[:, 0] == 0)
  mask = np.zeros((b, t))
  mask[:, p:] = 1  # 24 response tokens per row, bins of 16 positions: 32 and 16 tokens
  kw = dict(attention=spec, temperature=temp, bin_size=16, chunk=16)
  ok = probe_tail_alpha(graphdef, state, None, tokens, mask, pl, tight, min_count=20, **kw)
  np.testing.assert_allclose(ok, np.percentile(alpha[:, p:32], 5), rtol=1e-6)  # bin 1 only
  assert np.isnan(probe_tail_alpha(graphdef, state, None, tokens, mask, pl, tight,
                                   min_count=40, **kw))
