"""Tests for sparrow_jax.rl.rewards: verifiers, overlong penalty and the safe batch scorer."""

import os
import threading
import time

import numpy as np
import pytest

from sparrow_jax.rl import rewards as R


# Module-level so that the "spawn" process backend can import them.
def flaky_verifier(completion: str, answer: str) -> float:
  if answer == "boom":
    raise RuntimeError("verifier crashed")
  if answer == "hang":
    time.sleep(30.0)
  if answer == "nan":
    return float("nan")
  if answer == "die":
    os._exit(3)  # a verifier that takes its (process) worker down
  return float(completion.strip() == answer)


def sleepy_verifier(completion: str, answer: str) -> float:
  if answer == "hang":
    time.sleep(2.0)  # long enough to miss the deadline, short enough to finish within the test
  return float(completion == answer)


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


# ----------------------------------------------------------------------------- safe scoring


def test_score_batch_counts_errors_and_nonfinite():
  comps = ["1", "2", "x", "3", "4"]
  answers = ["1", "boom", "nan", "3", "5"]
  res = R.score_batch(flaky_verifier, comps, answers, timeout_s=10.0, num_workers=2)
  np.testing.assert_array_equal(res.rewards, [1, 0, 0, 1, 0])
  assert res.rewards.dtype == np.float32
  assert (res.num_errors, res.num_timeouts) == (2, 0)
  assert any("RuntimeError: verifier crashed" in e for e in res.errors)
  assert res.metrics() == {"reward/num_errors": 2.0, "reward/num_timeouts": 0.0}


def test_score_batch_timeout_thread_backend():
  comps = ["a", "b", "c", "d", "e"]
  answers = ["a", "hang", "c", "hang", "x"]
  t0 = time.monotonic()
  res = R.score_batch(sleepy_verifier, comps, answers, timeout_s=0.3, num_workers=2)
  elapsed = time.monotonic() - t0
  np.testing.assert_array_equal(res.rewards, [1, 0, 1, 0, 0])
  assert (res.num_errors, res.num_timeouts) == (0, 2)
  assert elapsed < 1.8, f"hung items must not block the batch ({elapsed=:.2f}s)"


def test_scorer_reused_after_timeouts_with_registered_name():
  with R.RewardScorer("exact_match", timeout_s=5.0, num_workers=1) as scorer:
    a = scorer(["85", "7"], ["85", "8"])
    b = scorer(["1"], ["1"])
  np.testing.assert_array_equal(a.rewards, [1, 0])
  np.testing.assert_array_equal(b.rewards, [1])
  # A hung worker is replaced: the next item is scored by a fresh one.
  with R.RewardScorer(sleepy_verifier, timeout_s=0.2, num_workers=1) as scorer:
    res = scorer(["a", "b", "c"], ["hang", "b", "c"])
    again = scorer(["d"], ["d"])
  np.testing.assert_array_equal(res.rewards, [0, 1, 1])
  assert res.num_timeouts == 1
  np.testing.assert_array_equal(again.rewards, [1])


def test_score_batch_process_backend_kills_hung_worker():
  comps = ["1", "2", "3", "4", "5", "6"]
  answers = ["1", "hang", "boom", "4", "die", "6"]
  t0 = time.monotonic()
  with R.RewardScorer(flaky_verifier, timeout_s=1.0, num_workers=2, backend="process") as s:
    original = [w.proc for w in s._workers]
    started = time.monotonic()
    res = s(comps, answers)
    scored = time.monotonic()
    # The worker stuck in time.sleep(30) was killed and the one that exited is gone (either
    # may be a replacement already); the pool is back to two live workers.
    assert sum(p.is_alive() for p in original) <= 1
    assert all(w.proc.is_alive() for w in s._workers) and len(s._workers) == 2
    current = [w.proc for w in s._workers]
  assert not any(p.is_alive() for p in current)  # close() stops every worker
  np.testing.assert_array_equal(res.rewards, [1, 0, 0, 1, 0, 1])
  assert (res.num_errors, res.num_timeouts) == (2, 1)
  assert any("WorkerDied" in e for e in res.errors)
  assert scored - started < 10.0, f"{scored - started=:.1f}s"
  assert time.monotonic() - t0 < 40.0


def test_score_batch_math_verify_in_threads():
  comps = [r"\boxed{85}", r"\boxed{\frac{1}{2}}", r"\boxed{86}", "no answer"]
  res = R.score_batch("math_verify", comps, ["85", "0.5", "85", "85"], timeout_s=30.0)
  np.testing.assert_array_equal(res.rewards, [1, 1, 0, 0])
  assert (res.num_errors, res.num_timeouts) == (0, 0)


def test_scorer_argument_errors():
  with pytest.raises(ValueError, match="backend='gpu'"):
    R.RewardScorer("exact_match", backend="gpu")
  with pytest.raises(ValueError, match="timeout_s=0"):
    R.RewardScorer("exact_match", timeout_s=0)
  with pytest.raises(ValueError, match="2 completions but 1 answers"):
    R.score_batch("exact_match", ["a", "b"], ["a"])
  with pytest.raises(ValueError, match="module-level function"):
    R.RewardScorer(lambda c, a: 1.0, backend="process")


def test_replacing_a_hung_worker_does_not_hold_up_the_batch():
  from tests.rl.slow_start_verifier import hang_or_match  # workers need 3 s to start
  with R.RewardScorer(hang_or_match, timeout_s=1.0, num_workers=2, backend="process") as s:
    t0 = time.monotonic()
    res = s(["x", "a", "b", "c"], ["hang", "a", "b", "z"])
    elapsed = time.monotonic() - t0
    np.testing.assert_array_equal(res.rewards, [0, 1, 1, 0])
    assert res.num_timeouts == 1
    assert elapsed < 2.5, f"{elapsed=:.2f}s: the 3 s start of the replacement was waited for"
    assert sum(not w.ready for w in s._workers) == 1  # the replacement is still starting
    again = s(["d", "e", "f"], ["d", "e", "f"])  # served by the live worker, then both
    np.testing.assert_array_equal(again.rewards, [1, 1, 1])


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


def test_process_scorer_loads_a_custom_verifier_from_a_file_in_each_worker(tmp_path):
  # A function loaded from a file path cannot be unpickled by name in a spawned process: the
  # spec goes to the workers and each loads it (the trainer's scorer is a process pool).
  f = tmp_path / "file_reward.py"
  f.write_text("def starts_right(completion, answer):\n"
               "    return float(completion.strip().startswith(answer))\n")
  with R.RewardScorer(f"{f}:starts_right", timeout_s=5.0, num_workers=1,
                      backend="process") as s:
    res = s(["42 yes", "no"], ["42", "42"])
  np.testing.assert_array_equal(res.rewards, [1.0, 0.0])
  assert res.num_errors == 0 and res.num_timeouts == 0
