"""Tests for sparrow_jax.rl.verifier_pool: the batch scorer's deadlines, error counts, worker
replacement and process backend."""

import os
import time

import numpy as np
import pytest

from sparrow_jax.rl import verifier_pool as VP


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


def test_score_batch_counts_errors_and_nonfinite():
  comps = ["1", "2", "x", "3", "4"]
  answers = ["1", "boom", "nan", "3", "5"]
  res = VP.score_batch(flaky_verifier, comps, answers, timeout_s=10.0, num_workers=2)
  np.testing.assert_array_equal(res.rewards, [1, 0, 0, 1, 0])
  assert res.rewards.dtype == np.float32
  assert (res.num_errors, res.num_timeouts) == (2, 0)
  assert any("RuntimeError: verifier crashed" in e for e in res.errors)
  assert res.metrics() == {"reward/num_errors": 2.0, "reward/num_timeouts": 0.0}


def test_score_batch_timeout_thread_backend():
  comps = ["a", "b", "c", "d", "e"]
  answers = ["a", "hang", "c", "hang", "x"]
  t0 = time.monotonic()
  res = VP.score_batch(sleepy_verifier, comps, answers, timeout_s=0.3, num_workers=2)
  elapsed = time.monotonic() - t0
  np.testing.assert_array_equal(res.rewards, [1, 0, 1, 0, 0])
  assert (res.num_errors, res.num_timeouts) == (0, 2)
  assert elapsed < 1.8, f"hung items must not block the batch ({elapsed=:.2f}s)"


def test_scorer_reused_after_timeouts_with_registered_name():
  with VP.RewardScorer("exact_match", timeout_s=5.0, num_workers=1) as scorer:
    a = scorer(["85", "7"], ["85", "8"])
    b = scorer(["1"], ["1"])
  np.testing.assert_array_equal(a.rewards, [1, 0])
  np.testing.assert_array_equal(b.rewards, [1])
  # A hung worker is replaced: the next item is scored by a fresh one.
  with VP.RewardScorer(sleepy_verifier, timeout_s=0.2, num_workers=1) as scorer:
    res = scorer(["a", "b", "c"], ["hang", "b", "c"])
    again = scorer(["d"], ["d"])
  np.testing.assert_array_equal(res.rewards, [0, 1, 1])
  assert res.num_timeouts == 1
  np.testing.assert_array_equal(again.rewards, [1])


def test_score_batch_process_backend_kills_hung_worker():
  comps = ["1", "2", "3", "4", "5", "6"]
  answers = ["1", "hang", "boom", "4", "die", "6"]
  t0 = time.monotonic()
  with VP.RewardScorer(flaky_verifier, timeout_s=1.0, num_workers=2, backend="process") as s:
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
  res = VP.score_batch("math_verify", comps, ["85", "0.5", "85", "85"], timeout_s=30.0)
  np.testing.assert_array_equal(res.rewards, [1, 1, 0, 0])
  assert (res.num_errors, res.num_timeouts) == (0, 0)


def test_scorer_argument_errors():
  with pytest.raises(ValueError, match="backend='gpu'"):
    VP.RewardScorer("exact_match", backend="gpu")
  with pytest.raises(ValueError, match="timeout_s=0"):
    VP.RewardScorer("exact_match", timeout_s=0)
  with pytest.raises(ValueError, match="2 completions but 1 answers"):
    VP.score_batch("exact_match", ["a", "b"], ["a"])
  with pytest.raises(ValueError, match="module-level function"):
    VP.RewardScorer(lambda c, a: 1.0, backend="process")


def test_replacing_a_hung_worker_does_not_hold_up_the_batch():
  from tests.rl.slow_start_verifier import hang_or_match  # workers need 3 s to start
  with VP.RewardScorer(hang_or_match, timeout_s=1.0, num_workers=2, backend="process") as s:
    t0 = time.monotonic()
    res = s(["x", "a", "b", "c"], ["hang", "a", "b", "z"])
    elapsed = time.monotonic() - t0
    np.testing.assert_array_equal(res.rewards, [0, 1, 1, 0])
    assert res.num_timeouts == 1
    assert elapsed < 2.5, f"{elapsed=:.2f}s: the 3 s start of the replacement was waited for"
    assert sum(not w.ready for w in s._workers) == 1  # the replacement is still starting
    again = s(["d", "e", "f"], ["d", "e", "f"])  # served by the live worker, then both
    np.testing.assert_array_equal(again.rewards, [1, 1, 1])


def test_process_scorer_loads_a_custom_verifier_from_a_file_in_each_worker(tmp_path):
  # A function loaded from a file path cannot be unpickled by name in a spawned process: the
  # spec goes to the workers and each loads it (the trainer's scorer is a process pool).
  f = tmp_path / "file_reward.py"
  f.write_text("def starts_right(completion, answer):\n"
               "    return float(completion.strip().startswith(answer))\n")
  with VP.RewardScorer(f"{f}:starts_right", timeout_s=5.0, num_workers=1,
                       backend="process") as s:
    res = s(["42 yes", "no"], ["42", "42"])
  np.testing.assert_array_equal(res.rewards, [1.0, 0.0])
  assert res.num_errors == 0 and res.num_timeouts == 0
