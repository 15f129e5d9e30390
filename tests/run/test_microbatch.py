"""Micro-batch packing and the driver (run/microbatch.py): buckets, token budgets, padding,
row divisibility, and gather/scatter round trips."""

import numpy as np
import pytest

from sparrow_jax.run import microbatch as mb


def test_length_buckets_bound_the_padding():
  assert [mb.length_bucket(n) for n in (1, 9, 16, 17, 33, 100)] == [16, 16, 16, 32, 48, 112]
  for n in range(17, 5000, 37):
    b = mb.length_bucket(n)
    assert n <= b and b % 16 == 0
    if n > 128:  # above 128 tokens: at most 1/8 of an octave of padding
      assert b - n < max(n // 8, 16), (n, b)
  assert mb.length_bucket(34816) == 36864
  assert mb.length_bucket(34816, max_length=34816) == 34816  # never past the longest row
  assert mb.length_bucket(20, per_octave=4) == 32
  with pytest.raises(ValueError, match="per_octave=3"):
    mb.length_bucket(20, per_octave=3)


def test_rows_buckets():
  assert [mb.rows_bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12,
                                                      12, 16]


def test_three_short_rows_and_one_long_one_pad_little():
  """Responses of 16, 16, 16 and 512 tokens after 8-token prompts: one row per bucket
  of its own length; a budget that holds the three short ones together."""
  lengths = np.array([24, 520, 24, 24])
  plan = mb.plan(lengths, max_tokens=1024)
  assert [sorted(m.index.tolist()) for m in plan] == [[0, 2, 3], [1]]
  assert [(m.rows, m.length) for m in plan] == [(3, 32), (1, 576)]
  frac = mb.padding_frac(plan, lengths)
  assert frac <= 0.15, frac
  # Today's layout: every row padded to the batch's power-of-two bucket.
  one_piece = 1 - lengths.sum() / (4 * 1024)
  assert one_piece > 0.6 and frac < one_piece / 4


def test_token_budget_and_divisor():
  rng = np.random.default_rng(0)
  lengths = rng.integers(20, 3000, 64)
  for div in (1, 2, 4):
    plan = mb.plan(lengths, divisor=div, max_tokens=4096)
    seen = np.concatenate([m.index for m in plan])
    assert sorted(seen.tolist()) == list(range(64))  # every row exactly once
    for m in plan:
      assert m.rows % div == 0 and len(m.index) <= m.rows
      assert m.length >= lengths[m.index].max()
      assert (m.rows // div) * m.length <= 4096 or len(m.index) == 1
  # A row longer than the budget goes alone.
  plan = mb.plan([10, 5000, 12], max_tokens=1024)
  assert [len(m.index) for m in plan] == [2, 1] and plan[1].length >= 5000


def test_fixed_rows_are_sorted_and_padded_to_their_own_length():
  lengths = np.array([5, 300, 7, 290, 6, 8])
  plan = mb.plan(lengths, max_rows=2)
  assert [m.index.tolist() for m in plan] == [[0, 4], [2, 5], [3, 1]]
  assert [m.rows for m in plan] == [2, 2, 2] and [m.length for m in plan] == [16, 16, 320]
  with pytest.raises(ValueError, match="max_rows=3 must be a positive multiple"):
    mb.plan(lengths, max_rows=3, divisor=2)
  with pytest.raises(ValueError, match="exactly one"):
    mb.plan(lengths)


def test_gather_pads_rows_and_time_and_scatter_restores():
  rng = np.random.default_rng(1)
  b, t, k = 5, 40, 3
  arrays = {"tokens": rng.integers(0, 9, (b, t)).astype(np.int32),
            "lengths": np.array([40, 3, 17, 5, 30], np.int32),
            "rollout_topk_logp": rng.normal(size=(b, t, k)).astype(np.float32)}
  m = mb.MicroBatch(index=np.array([3, 1]), rows=4, length=16)
  g = mb.gather(arrays, m)
  assert g["tokens"].shape == (4, 16) and g["rollout_topk_logp"].shape == (4, 16, k)
  np.testing.assert_array_equal(g["tokens"][:2], arrays["tokens"][[3, 1], :16])
  np.testing.assert_array_equal(g["lengths"], [5, 3, 1, 1])  # padding rows: one token
  assert (g["rollout_topk_logp"][2:] == -1e9).all() and (g["tokens"][2:] == 0).all()
  long = mb.MicroBatch(index=np.array([0]), rows=1, length=48)  # past T: zero padded
  assert mb.gather(arrays, long)["tokens"].shape == (1, 48)
  full = {}
  for piece in (m, mb.MicroBatch(np.array([0, 2, 4]), 3, 48)):
    res = mb.gather(arrays, piece, ["tokens", "lengths"])
    mb.scatter(full, piece, res, b, t)
  np.testing.assert_array_equal(full["lengths"], [40, 3, 17, 5, 30])
  np.testing.assert_array_equal(full["tokens"][[0, 2, 4]], arrays["tokens"][[0, 2, 4]])
  np.testing.assert_array_equal(full["tokens"][[1, 3], :16], arrays["tokens"][[1, 3], :16])
  assert (full["tokens"][[1, 3], 16:] == 0).all()  # beyond the micro-batch's length


def test_run_calls_the_program_per_micro_batch_and_reassembles():
  rng = np.random.default_rng(2)
  lengths = np.array([3, 9, 33, 4, 20, 2], np.int32)
  tokens = rng.integers(1, 50, (6, 33)).astype(np.int32)
  arrays = {"tokens": tokens, "lengths": lengths}
  plan = mb.plan(lengths, max_tokens=48)
  shapes = []

  def fn(inputs):
    shapes.append(inputs["tokens"].shape)
    return {"double": inputs["tokens"] * 2, "n": inputs["lengths"] + 1}

  out = mb.run(fn, arrays, plan, place=lambda x: x)
  assert len(shapes) == len(plan) and len(set(shapes)) > 1
  np.testing.assert_array_equal(out["n"], lengths + 1)
  for i, n in enumerate(lengths):
    np.testing.assert_array_equal(out["double"][i, :n], 2 * tokens[i, :n])
