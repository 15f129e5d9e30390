"""Tests for sparrow_jax.rl.rewards: the verifier registry, the verifiers and the overlong
penalty (the pool that runs them: test_verifier_pool.py)."""

import threading

import numpy as np
import pytest

from sparrow_jax.rl import rewards as R


# ----------------------------------------------------------------------------- registry


def test_registry():
  assert {"math_verify", "exact_match", "boxed_exact"} <= set(R.list_rewards())
  assert R.get_reward("exact_match") is R.exact_match
  with pytest.raises(ValueError, match=r"name='nope' is not registered.*boxed_exact"):
    R.get_reward("nope")

  @R.register_reward("test_always_one")
  def always_one(completion, answer):
    return 1.0

  assert R.get_reward("test_always_one")("x", "y") == 1.0
  with pytest.raises(ValueError, match="already registered"):
    R.register_reward("test_always_one")(lambda c, a: 0.0)


# ----------------------------------------------------------------------------- verifiers


def test_last_boxed_nested_braces():
  text = r"first \boxed{1} then \boxed{\frac{1}{2}} and finally \boxed{\sqrt{a_{1}} + 2}"
  assert R.last_boxed(text) == r"\sqrt{a_{1}} + 2"
  assert R.last_boxed(r"\boxed{12} oops \boxed{3") == "12"  # unbalanced last box: use earlier
  assert R.last_boxed(r"\fbox{7}") == "7"
  assert R.last_boxed("no box here") is None


@pytest.mark.parametrize("completion, answer, want", [
    (r"so the answer is \boxed{85}", "85", 1.0),
    (r"\boxed{ 85. }", "85", 1.0),
    (r"\boxed{$-11$}", "-11", 1.0),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{86}", "85", 0.0),
    ("85", "85", 0.0),  # no box: boxed_exact insists on the format
    (r"\boxed{1,000}", "1000", 1.0),
])
def test_boxed_exact(completion, answer, want):
  assert R.boxed_exact(completion, answer) == want


@pytest.mark.parametrize("completion, answer, want", [
    ("8 - 6 = 2\n\nSo the answer is 2.", "2", 1.0),  # prose: the last number
    ("2+3 = 5, and 5 is odd", "5", 1.0),
    ("8-6 = 2, then 2+1 = 3", "2", 0.0),  # the last number is the one it commits to
    (r"5 and \boxed{-11}, then 3", "-11", 1.0),  # a box wins over later numbers
    (r"\boxed{4} but really 5", "5", 0.0),
    ("0-1 = -1", "-1", 1.0), ("it is 1,000.", "1000", 1.0), ("2.50", "2.5", 0.0),
    ("no digits", "3", 0.0), ("", "3", 0.0),
    ("7", r"\boxed{7}", 1.0),  # a boxed gold answer is unboxed
])
def test_boxed_or_last_number(completion, answer, want):
  assert R.boxed_or_last_number(completion, answer) == want
  assert R.get_reward("boxed_or_last_number") is R.boxed_or_last_number


@pytest.mark.parametrize("completion, answer, want", [
    (" 85\n", "85", 1.0), ("85.", "85", 1.0), ("$85$", "85", 1.0), ("Yes", "yes", 1.0),
    ("8 5", "85", 0.0), ("-85", "85", 0.0),
])
def test_exact_match(completion, answer, want):
  assert R.exact_match(completion, answer) == want


@pytest.mark.parametrize("completion, answer, want", [
    (r"The sum is \boxed{85}.", "85", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),  # equivalence, not string equality
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{-11}", "-11", 1.0),
    (r"\boxed{86}", "85", 0.0),
    ("I don't know", "85", 0.0),
])
def test_math_verify(completion, answer, want):
  assert R.math_verify_reward(completion, answer) == want


def test_math_verify_runs_off_the_main_thread():
  out = {}
  th = threading.Thread(target=lambda: out.setdefault("r", R.math_verify_reward(
      r"\boxed{\frac{3}{4}}", "0.75")))
  th.start()
  th.join(60)
  assert out["r"] == 1.0  # math-verify's SIGALRM timeout would raise ValueError here


# ----------------------------------------------------------------------------- overlong


def test_overlong_penalty_dapo():
  # L_max = 10, L_cache = 4: no penalty up to 6, linear to -1 at 10, -1 beyond.
  got = R.overlong_penalty([5, 6, 7, 9, 10, 11], max_len=10, buffer_len=4)
  np.testing.assert_allclose(got, [0, 0, -0.25, -0.75, -1.0, -1.0], atol=1e-7)
  assert got.dtype == np.float32
  half = R.overlong_penalty([7, 12], max_len=10, buffer_len=4, penalty_factor=0.5)
  np.testing.assert_allclose(half, [-0.125, -0.5], atol=1e-7)
  with pytest.raises(ValueError, match="buffer_len=11"):
    R.overlong_penalty([1], max_len=10, buffer_len=11)
  with pytest.raises(ValueError, match="max_len=0"):
    R.overlong_penalty([1], max_len=0, buffer_len=1)


def test_custom_reward_from_a_module_or_a_file(tmp_path, monkeypatch):
  from sparrow_jax.rl.rewards import get_reward
  f = tmp_path / "my_rewards.py"
  f.write_text("def starts_right(completion, answer):\n"
               "    return float(completion.strip().startswith(answer))\n"
               "LIMIT = 3\n"
               "def needs_three(a, b, c):\n    return 0.0\n")
  fn = get_reward(f"{f}:starts_right")
  assert fn("42 is it", "42") == 1.0 and fn("4", "42") == 0.0
  monkeypatch.syspath_prepend(str(tmp_path))
  assert get_reward("my_rewards:starts_right")("7", "7") == 1.0
  assert get_reward("sparrow_jax.rl.rewards:exact_match") is R.exact_match
  monkeypatch.chdir(tmp_path)
  assert get_reward("./my_rewards.py:starts_right")("1", "1") == 1.0
  for spec, msg in [(f"{tmp_path}/missing.py:f", "does not exist"),
                    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
                    (f"{f}:nope", "has no 'nope'; functions there: \\['needs_three', "
                                  "'starts_right'\\]"),
                    (f"{f}:LIMIT", "'LIMIT' has type int, not a function"),
                    (f"{f}:needs_three", "cannot be called as fn\\(completion, answer\\)"),
                    ("exact_matsh", "not registered")]:
    with pytest.raises(ValueError, match=msg):
      get_reward(spec)
  bad = tmp_path / "broken.py"
  bad.write_text("def f(:\n")
  with pytest.raises(ValueError, match="importing .*broken.py failed: SyntaxError"):
    get_reward(f"{bad}:f")
