"""Tests of SparsitySchedule, its pure budget lookup, the published presets and parse_schedule."""

import dataclasses
import json
import os
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.schedule import presets
from sparrow_jax.schedule.presets import parse_schedule
from sparrow_jax.schedule.schedule import (SparsitySchedule, budget_pages, max_budget,
                                           pages_attended, pages_held, pages_read,
                                           schedule_from_p5, beyond_calibrated_frac,
                                           uncalibrated_positions)

# Copy of the table in shared/papers/sparrow_release_facts.md, kept here so the test does not
# depend on that file: the presets must reproduce it exactly.
RELEASE_TABLE = """
| qwen3-1.7b-0.75 | 29 29 45 45 61 61 77 77 93 93 93 93 93 93 93 93 93 93 93 93 |
| qwen3-1.7b-0.80 | 29 45 61 77 93 93 125 125 125 157 157 157 157 157 157 157 157 157 157 157 |
| qwen3-1.7b-0.83 | 29 61 77 93 125 125 157 157 189 189 189 189 189 189 189 189 189 189 189 189 |
| qwen3-1.7b-0.86 | 29 61 93 93 125 157 189 221 221 253 253 253 253 253 253 253 253 253 253 253 |
| qwen3-1.7b-0.88 | 45 77 125 157 157 189 221 253 253 317 317 317 317 317 317 317 317 317 317 317 |
| qwen3-1.7b-0.90 | 45 93 157 189 221 253 317 317 381 381 381 381 381 381 381 381 381 381 381 381 |
| qwen3-1.7b-0.92 | 61 125 189 221 253 317 381 381 445 509 509 509 509 509 509 509 509 509 509 509 |
| qwen3-1.7b-0.94 | 77 157 221 317 381 445 509 509 637 765 765 765 765 765 765 765 765 765 765 765 |
| qwen3-4b-0.75 | 29 29 29 29 45 61 77 93 125 125 125 125 157 157 157 157 157 157 189 189 |
| qwen3-4b-0.80 | 29 29 45 61 77 93 125 157 157 157 189 221 221 221 221 221 221 221 221 221 |
| qwen3-4b-0.86 | 29 45 61 77 93 125 157 221 253 253 317 317 317 317 381 381 381 381 509 509 |
| qwen3-4b-0.88 | 29 61 93 125 157 189 253 317 381 445 445 509 509 509 637 637 637 637 637 637 |
| qwen3-4b-0.90 | 45 77 125 157 189 253 317 445 637 765 765 765 765 765 765 893 893 893 893 893 |
| qwen3-4b-0.92 | 45 93 157 189 253 381 445 765 893 1021 1021 1149 1149 1149 1149 1149 1149 1149 1149 1149 |
| qwen3-8b-0.75 | 29 29 29 45 45 77 77 77 93 93 93 93 125 125 125 125 125 125 157 157 |
| qwen3-8b-0.80 | 29 29 45 61 77 93 125 125 157 157 189 189 189 221 221 221 221 253 253 253 |
| qwen3-8b-0.86 | 29 45 61 77 125 157 189 253 253 253 253 317 317 317 317 317 317 385 445 445 |
| qwen3-8b-0.87 | 29 61 77 93 157 189 221 317 317 317 317 381 381 381 381 381 445 445 509 509 |
| qwen3-8b-0.92 | 45 93 125 189 253 445 509 637 765 765 765 893 893 893 893 893 1021 1021 1021 1021 |
| qwen3-14b-0.86 | 29 45 77 125 253 381 381 381 381 381 381 381 381 381 381 509 637 637 893 893 |
"""


def _release_rows():
  rows = {}
  for line in RELEASE_TABLE.strip().splitlines():
    _, name, values, _ = line.split("|")
    rows[name.strip()] = [int(v) for v in values.split()]
  return rows


def _ref_budget(s: SparsitySchedule, pos: int) -> int:
  """Plain-Python reference: value i while the sequence holds < bin_size * (i + 1) tokens."""
  if s.is_dense:
    return -(-max(pos, 0) // s.page_size)
  for i, b in enumerate(s.budgets):
    if pos < s.bin_size * (i + 1):
      return b
  return s.budgets[-1]


SCHEDULES = [
    presets.get_schedule("qwen3-1.7b-0.86"),
    presets.get_schedule("qwen3-14b-0.86"),
    presets.constant(7),
    SparsitySchedule(name="odd-bins", page_size=32, bin_size=100, budgets=(3, 1, 4, 1, 5)),
    presets.dense(),
]


def _random_positions(rng, s, shape):
  hi = s.bin_size * (s.num_bins + 2)
  pos = rng.integers(0, hi, size=shape)
  flat = pos.reshape(-1)
  edges = [0, 1, s.bin_size - 1, s.bin_size, s.bin_size + 1, hi - 1]
  flat[:len(edges)] = edges  # bin boundaries always covered
  return pos.astype(np.int32)


class BudgetLookupTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_python_reference(self):
    rng = np.random.default_rng(0)
    for s in SCHEDULES:
      pos = _random_positions(rng, s, (6, 50))
      got = self.variant(lambda p, s=s: budget_pages(s, p))(jnp.asarray(pos))
      chex.assert_shape(got, pos.shape)
      assert got.dtype == jnp.int32
      want = np.vectorize(lambda p, s=s: _ref_budget(s, int(p)))(pos)
      np.testing.assert_array_equal(np.asarray(got), want)

  def test_vmap_and_jit_of_vmap(self):
    rng = np.random.default_rng(1)
    for s in SCHEDULES:
      pos = _random_positions(rng, s, (5, 40))
      f = jax.vmap(lambda p, s=s: budget_pages(s, p))
      want = np.vectorize(lambda p, s=s: _ref_budget(s, int(p)))(pos)
      np.testing.assert_array_equal(np.asarray(f(pos)), want)
      np.testing.assert_array_equal(np.asarray(jax.jit(f)(pos)), want)
      scalar = jax.vmap(jax.vmap(lambda p, s=s: budget_pages(s, p)))(pos)  # scalars inside
      np.testing.assert_array_equal(np.asarray(scalar), want)

  def test_scalar_and_negative_positions(self):
    s = presets.get_schedule("qwen3-1.7b-0.86")
    assert int(budget_pages(s, 0)) == 29
    assert int(budget_pages(s, -5)) == 29  # documented: <= 0 falls into bin 0
    assert int(budget_pages(s, 10**9)) == 253

  def test_pages_attended_held_read(self):
    s = presets.get_schedule("qwen3-1.7b-0.86")
    pos = jnp.array([1, 16, 17, 500, 1999, 2000, 40_000, 100_000])
    np.testing.assert_array_equal(np.asarray(pages_held(s, pos)),
                                  [1, 1, 2, 32, 125, 125, 2500, 6250])
    np.testing.assert_array_equal(np.asarray(pages_attended(s, pos)),
                                  [32, 32, 32, 32, 32, 64, 256, 256])
    np.testing.assert_array_equal(np.asarray(pages_read(s, pos)),
                                  [1, 1, 2, 32, 32, 64, 256, 256])
    d = presets.dense()
    np.testing.assert_array_equal(np.asarray(pages_attended(d, pos)),
                                  np.asarray(pages_held(d, pos)))
    np.testing.assert_array_equal(np.asarray(pages_read(d, pos)),
                                  np.asarray(pages_held(d, pos)))

  def test_max_budget(self):
    s = presets.get_schedule("qwen3-4b-0.86")
    assert max_budget(s) == 509 and isinstance(max_budget(s), int)
    assert max_budget(s, 2000) == 45  # bins 0..1 reachable
    assert max_budget(s, 1999) == 29
    assert max_budget(presets.dense(), 33) == 3
    with pytest.raises(ValueError, match="dense"):
      max_budget(presets.dense())
    with pytest.raises(ValueError, match="max_position"):
      max_budget(s, 0)


class PresetTest(chex.TestCase):

  def test_tables_verbatim(self):
    rows = _release_rows()
    assert presets.names() == list(rows)
    for name, values in rows.items():
      s = presets.get_schedule(name)
      assert list(s.budgets) == values, name
      assert (s.page_size, s.bin_size, s.reserved_bos, s.reserved_recent) == (16, 2000, 1, 2)
      assert s.dense_layers == (0, 1) and s.landmark == "mean" and not s.is_dense
      assert s.tau == float(name.rsplit("-", 1)[1])
      # value i applies while the sequence holds fewer than 2000 * (i + 1) tokens
      last_in_bin = jnp.arange(1, 21) * 2000 - 1
      first_in_bin = jnp.arange(0, 20) * 2000
      np.testing.assert_array_equal(np.asarray(budget_pages(s, last_in_bin)), values)
      np.testing.assert_array_equal(np.asarray(budget_pages(s, first_in_bin)), values)
      # value + reserved = pages attended
      np.testing.assert_array_equal(np.asarray(pages_attended(s, first_in_bin)),
                                    np.asarray(values) + 3)

  def test_constant_and_dense(self):
    c = presets.constant(12)
    assert c.budgets == (12,) and c.tau is None and c.name == "constant-12"
    np.testing.assert_array_equal(np.asarray(budget_pages(c, jnp.array([1, 10**6]))), [12, 12])
    assert presets.constant(4, page_size=64).page_size == 64
    d = presets.dense()
    assert d.is_dense and d.reserved == 0 and d.layer_is_dense(5)
    assert presets.get_schedule("qwen3-8b-0.86").layer_is_dense(1)
    assert not presets.get_schedule("qwen3-8b-0.86").layer_is_dense(2)
    with pytest.raises(ValueError, match="qwen3-1.7b-0.86"):
      presets.get_schedule("qwen3-1.7b-0.99")


class ValidationTest(chex.TestCase):

  def test_errors_name_the_field(self):
    bad = [
        (dict(budgets=(4, 0)), r"budgets\[1\]=0"),
        (dict(budgets=(4, -2)), r"budgets\[1\]=-2"),
        (dict(budgets=(4.5,)), r"budgets\[0\]=4.5"),
        (dict(budgets=()), "budgets=()"),
        (dict(budgets="12"), "budgets='12'"),
        (dict(budgets=(4,), page_size=12), "page_size=12"),
        (dict(budgets=(4,), page_size=0), "page_size=0"),
        (dict(budgets=(4,), bin_size=0), "bin_size=0"),
        (dict(budgets=(4,), landmark="max"), "landmark='max'"),
        (dict(budgets=(4,), tau=1.5), "tau=1.5"),
        (dict(budgets=(4,), tau=0.0), "tau=0.0"),
        (dict(budgets=(4,), reserved_bos=-1), "reserved_bos=-1"),
        (dict(budgets=(4,), reserved_recent=0), "reserved_recent=0"),
        (dict(budgets=(4,), dense_layers=(0, 0)), "dense_layers"),
        (dict(budgets=(4,), dense_layers=(-1,)), "dense_layers"),
        (dict(budgets=(4,), is_dense=True, reserved_bos=0, reserved_recent=0), "budgets"),
        (dict(is_dense=True, reserved_bos=1, reserved_recent=0), "reserved_bos=1"),
        (dict(budgets=(4,), name=""), "name"),
    ]
    for kw, pattern in bad:
      with pytest.raises(ValueError, match=pattern):
        SparsitySchedule(**kw)

  def test_frozen_keyword_only_and_normalised(self):
    s = SparsitySchedule(budgets=[3, 5], dense_layers=[2, 0])
    assert s.budgets == (3, 5) and s.dense_layers == (0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
      s.page_size = 32
    with pytest.raises(TypeError):
      SparsitySchedule("x", 16)  # pylint: disable=too-many-function-args
    assert hash(s) == hash(SparsitySchedule(budgets=(3, 5), dense_layers=(0, 2)))


class JsonTest(chex.TestCase):

  def test_round_trip(self):
    with tempfile.TemporaryDirectory() as d:
      for s in SCHEDULES + [SparsitySchedule(budgets=(2,), landmark="quest", tau=None),
                            SparsitySchedule(budgets=(2, 4), calibrated_to=96)]:
        path = os.path.join(d, f"{s.name}.json")
        s.to_json(path)
        assert SparsitySchedule.from_json(path) == s
        with open(path) as f:
          assert json.load(f)["budgets"] == list(s.budgets)

  def test_malformed_files(self):
    with tempfile.TemporaryDirectory() as d:
      p = os.path.join(d, "bad.json")
      with open(p, "w") as f:
        f.write("{not json")
      with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        SparsitySchedule.from_json(p)
      with open(p, "w") as f:
        json.dump({"budgets": [4, 0]}, f)
      with pytest.raises(ValueError, match=r"bad.json.*budgets\[1\]=0"):
        SparsitySchedule.from_json(p)
      with open(p, "w") as f:
        json.dump({"budgets": [4], "page": 16}, f)
      with pytest.raises(ValueError, match="bad.json.*unknown field.*'page'"):
        SparsitySchedule.from_json(p)
      with open(p, "w") as f:
        json.dump([1, 2], f)
      with pytest.raises(ValueError, match="bad.json.*JSON object"):
        SparsitySchedule.from_json(p)
      with pytest.raises(ValueError, match="missing.json.*does not exist"):
        SparsitySchedule.from_json(os.path.join(d, "missing.json"))
      for bad in (0, -32, 1.5, "64", True):
        with open(p, "w") as f:
          json.dump({"budgets": [4], "calibrated_to": bad}, f)
        with pytest.raises(ValueError, match="bad.json.*calibrated_to"):
          SparsitySchedule.from_json(p)


class CalibratedRangeTest(chex.TestCase):

  def test_tokens_past_the_calibrated_positions(self):
    s = SparsitySchedule(name="cal", bin_size=32, budgets=(2, 8), calibrated_to=64)
    # Row 0: prompt 10, tokens at indices 10..79 (70): 16 of them (64..79) past 64.
    # Row 1: prompt 70 (already past), 5 tokens: all past. Row 2: 20 tokens ending at 40.
    frac = beyond_calibrated_frac(s, [10, 70, 20], [80, 75, 40])
    assert frac == pytest.approx((16 + 5 + 0) / (70 + 5 + 20))
    assert beyond_calibrated_frac(s, [10], [64]) == 0.0  # last token at index 63
    assert beyond_calibrated_frac(s, [10], [65]) == pytest.approx(1 / 55)
    assert beyond_calibrated_frac(s, [5], [5]) == 0.0  # nothing generated
    assert beyond_calibrated_frac(s.replace(calibrated_to=None), [10], [80]) is None
    assert beyond_calibrated_frac(presets.dense(), [10], [80]) is None

  def test_warning_names_the_range_and_budget(self):
    s = SparsitySchedule(name="cal", bin_size=32, budgets=(2, 8), calibrated_to=64)
    assert uncalibrated_positions(s, 64) is None  # last token at position 63
    assert "64-64" in uncalibrated_positions(s, 65)
    msg = uncalibrated_positions(s, 300)
    assert "'cal'" in msg and "64-299" in msg and "(8 pages)" in msg
    assert uncalibrated_positions(s.replace(calibrated_to=None), 300) is None


class ParseTest(chex.TestCase):

  def test_forms(self):
    assert parse_schedule("qwen3-8b-0.87") == presets.get_schedule("qwen3-8b-0.87")
    assert parse_schedule("dense").is_dense
    assert parse_schedule("constant:40").budgets == (40,)
    with tempfile.TemporaryDirectory() as d:
      p = os.path.join(d, "s.json")
      s = SparsitySchedule(name="mine", budgets=(8, 16))
      s.to_json(p)
      assert parse_schedule(p) == s

  def test_errors(self):
    for spec in ("constant:0", "constant:x", "constant:"):
      with pytest.raises(ValueError, match="constant:K"):
        parse_schedule(spec)
    with pytest.raises(ValueError, match="constant:K.*dense.*qwen3-1.7b-0.86"):
      parse_schedule("qwen3-1.7b-0.99")
    with pytest.raises(ValueError, match="does not exist"):
      parse_schedule("no/such/file.json")


class FromP5Test(chex.TestCase):

  def test_smallest_budget_non_decreasing(self):
    nan = np.nan
    # columns: budgets 4, 8, 16 (given out of order to check sorting)
    p5 = np.array([[0.95, 0.90, 0.97],   # bin 0: 4 ok
                   [0.70, 0.95, 0.88],   # bin 1: 8
                   [0.90, 0.95, 0.80],   # bin 2: 4 ok, but non-decreasing -> 8
                   [0.50, 0.80, 0.60],   # bin 3: nothing reaches tau -> 16, infeasible
                   [nan, nan, nan]])     # bin 4: no data -> inherits 16
    s, feasible = schedule_from_p5(p5, [4, 16, 8], tau=0.86, bin_size=512, page_size=32)
    assert s.budgets == (4, 8, 8, 16, 16)
    np.testing.assert_array_equal(feasible, [True, True, True, False, False])
    assert s.tau == 0.86 and s.page_size == 32 and s.bin_size == 512
    with pytest.raises(ValueError, match="p5 shape"):
      schedule_from_p5(p5[:, :2], [4, 16, 8], tau=0.86, bin_size=512)
