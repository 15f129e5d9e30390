"""avg@k, pass@k (unbiased, Chen et al.) and maj@k against hand counts."""

import itertools
import math

import numpy as np
import pytest

from sparrow_jax.rl.eval_metrics import (avg_at_k, eval_summary, maj_at_k, majority_vote,
                                         pass_at_k, pass_at_k_estimator)

REWARDS = [[1, 0, 0, 1],   # 2 of 4 correct
           [0, 0, 0, 0],   # none
           [1, 1, 1, 1]]   # all


def test_avg_at_k_hand_count():
  assert avg_at_k(REWARDS) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
  assert avg_at_k(REWARDS, 1) == pytest.approx((1 + 0 + 1) / 3)
  assert avg_at_k(REWARDS, 3) == pytest.approx((1 / 3 + 0 + 1) / 3)
  assert avg_at_k([[0.5, 0.25]], 2) == 0.375  # non-binary rewards are averaged as they are
  with pytest.raises(ValueError, match="prompt 0 has 2 samples: expected >= k=3"):
    avg_at_k([[1, 0]], 3)
  with pytest.raises(ValueError, match="no prompts"):
    avg_at_k([])


def test_pass_at_k_matches_combinatorics_and_enumeration():
  # n = 4, c = 2: pass@1 = 1/2, pass@2 = 1 - C(2,2)/C(4,2) = 5/6, pass@3 = 1.
  assert pass_at_k_estimator(4, 2, 1) == pytest.approx(0.5)
  assert pass_at_k_estimator(4, 2, 2) == pytest.approx(5 / 6)
  assert pass_at_k_estimator(4, 2, 3) == 1.0
  assert pass_at_k_estimator(4, 0, 4) == 0.0
  assert pass_at_k(REWARDS, 2) == pytest.approx((5 / 6 + 0 + 1) / 3)
  # Against the definition: the share of k-subsets with at least one correct sample.
  rng = np.random.default_rng(0)
  for _ in range(20):
    n = int(rng.integers(1, 9))
    correct = rng.random(n) < 0.4
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(range(n), k))
      ref = np.mean([correct[list(s)].any() for s in subsets])
      assert pass_at_k_estimator(n, int(correct.sum()), k) == pytest.approx(ref)
      c = int(correct.sum())
      closed = 1 - math.comb(n - c, k) / math.comb(n, k)
      assert pass_at_k_estimator(n, c, k) == pytest.approx(closed)
  # threshold: 0.9 counts as correct at 0.5 but not at 1.0.
  assert pass_at_k([[0.9, 0.0]], 1) == 0.5
  assert pass_at_k([[0.9, 0.0]], 1, threshold=1.0) == 0.0
  with pytest.raises(ValueError, match="k=0"):
    pass_at_k(REWARDS, 0)
  with pytest.raises(ValueError, match="n=2, c=3"):
    pass_at_k_estimator(2, 3, 1)


def test_majority_vote_and_maj_at_k():
  assert majority_vote(["5", "7", "5"]) == ("5", 0)
  # Tie 1-1: the answer seen first wins, whatever the order of hashing.
  assert majority_vote(["7", "5"]) == ("7", 0)
  assert majority_vote([None, "3", "4", "4", "3"]) == ("3", 1)
  assert majority_vote([None, None]) == (None, -1)
  answers = [["12", "13", "12", "13"],     # tie at k=4 -> "12" (first), correct
             ["1", "2", "2", None],        # "2" wins, wrong
             [None, None, "9", "9"],       # k=2: nobody answered -> wrong; k=4: "9", correct
             ["a", "b", "b", "b"]]         # k=1: "a" (wrong); k=4: "b" (correct)
  rewards = [[1, 0, 1, 0],
             [1, 0, 0, 0],
             [0, 0, 1, 1],
             [0, 1, 1, 1]]
  assert maj_at_k(answers, rewards, 4) == pytest.approx(3 / 4)
  # k=2: ties in prompts 0 ("12" first, correct) and 1 ("1" first, correct); 2 unanswered.
  assert maj_at_k(answers, rewards, 2) == pytest.approx(2 / 4)
  assert maj_at_k(answers, rewards, 1) == pytest.approx(2 / 4)  # prompts 0 and 1
  with pytest.raises(ValueError, match="prompt 0 has 3 answers and 4 rewards"):
    maj_at_k([["1", "2", "3"]], [[1, 0, 0, 0]], 2)
  with pytest.raises(ValueError, match="1 answer lists for 2 reward lists"):
    maj_at_k([["1"]], [[1], [0]], 1)


def test_eval_summary_keys():
  answers = [["x", "y", "x", "x"], ["0"] * 4, ["z"] * 4]
  out = eval_summary(REWARDS, answers, ks=(1, 4))
  assert set(out) == {"eval/prompts", "eval/avg@1", "eval/pass@1", "eval/maj@1",
                      "eval/avg@4", "eval/pass@4", "eval/maj@4"}
  assert out["eval/pass@4"] == pytest.approx(2 / 3)
  assert out["eval/avg@4"] == pytest.approx(0.5)
  assert out["eval/maj@4"] == pytest.approx(2 / 3)  # "x" correct, "0" wrong, "z" correct
  assert "eval/maj@1" not in eval_summary(REWARDS, ks=(1,))
