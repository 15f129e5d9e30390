"""avg@k, pass@k (unbiased, Chen et al.), maj@k and weighted voting (ARRoL rank weights,
DeepConf trace confidence) against hand counts."""

import itertools
import math

import numpy as np
import pytest

from sparrow_jax.rl.eval_metrics import (avg_at_k, eval_summary, maj_at_k, majority_vote,
                                         pass_at_k, pass_at_k_estimator, rank_weights,
                                         token_confidence, trace_confidence, weighted_maj_at_k,
                                         weighted_vote)

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


def test_weighted_vote_hand_counts():
  # "a": 0.2 + 0.3 = 0.5, "b": 0.9 -> "b" at index 1.
  assert weighted_vote(["a", "b", "a"], [0.2, 0.9, 0.3]) == ("b", 1)
  # Plain majority would pick "a" (2 votes); weights overturn it only when heavier.
  assert weighted_vote(["a", "b", "a"], [0.5, 0.9, 0.5]) == ("a", 0)
  # Ties (exact and up to float rounding: 1/3 + 2/3 vs 1) go to the first-seen answer.
  assert weighted_vote(["x", "y"], [1.0, 1.0]) == ("x", 0)
  assert weighted_vote(["y", "x", "x"], [1.0, 1 / 3, 2 / 3]) == ("y", 0)
  assert weighted_vote(["x", "x", "y"], [1 / 3, 2 / 3, 1.0]) == ("x", 0)
  # None does not vote, even with the largest weight; nobody answering gives (None, -1).
  assert weighted_vote([None, "c", "d"], [5.0, 0.1, 0.2]) == ("d", 2)
  assert weighted_vote([None, None], [1.0, 1.0]) == (None, -1)
  assert weighted_vote([], []) == (None, -1)
  assert weighted_vote(["only"], [0.0]) == ("only", 0)  # a single candidate wins at any weight
  # Equal weights reproduce the plain majority vote.
  ans = ["3", "4", "4", None, "3", "3"]
  assert weighted_vote(ans, [1.0] * 6) == majority_vote(ans)
  with pytest.raises(ValueError, match="2 weights for 3 answers"):
    weighted_vote(["a", "b", "c"], [1.0, 1.0])
  with pytest.raises(ValueError, match="finite values >= 0"):
    weighted_vote(["a", "b"], [1.0, -0.5])


def test_rank_weights_hand_counts():
  # Sorted order 0.1 < 0.4 < 0.7 < 2.0: ranks 0..3 rescaled by 3.
  np.testing.assert_allclose(rank_weights([0.7, 0.1, 2.0, 0.4]), [2 / 3, 0, 1, 1 / 3])
  # Ties share the mean rank: scores [1, 1, 3] -> ranks [0.5, 0.5, 2] / 2.
  np.testing.assert_allclose(rank_weights([1.0, 1.0, 3.0]), [0.25, 0.25, 1.0])
  np.testing.assert_allclose(rank_weights([5.0, 5.0, 5.0]), [0.5, 0.5, 0.5])
  np.testing.assert_array_equal(rank_weights([-3.0]), [1.0])  # a single candidate
  assert rank_weights([]).shape == (0,)
  # Only the order matters: a monotone transform of the scores gives the same weights.
  s = np.array([-2.0, 0.3, 1.5, 0.1])
  np.testing.assert_array_equal(rank_weights(s), rank_weights(1 / (1 + np.exp(-s))))
  with pytest.raises(ValueError, match="finite"):
    rank_weights([0.1, float("nan")])


def test_trace_confidence_hand_counts():
  # k = 2 log-probs per token; C_t = -mean: [1, 3, 2, 6, 4].
  lp = -np.array([[0.5, 1.5], [2.0, 4.0], [1.0, 3.0], [6.0, 6.0], [3.0, 5.0]])
  np.testing.assert_allclose(token_confidence(lp), [1, 3, 2, 6, 4])
  # window 2: groups [2, 2.5, 4, 5]; lowest 50% = mean(2, 2.5).
  assert trace_confidence(lp, window=2, lowest_frac=0.5) == pytest.approx(2.25)
  # lowest 10% of 4 groups -> ceil(0.4) = 1 group: the minimum.
  assert trace_confidence(lp, window=2, lowest_frac=0.1) == pytest.approx(2.0)
  # lowest_frac = 1: the mean of all groups; window 1: the token confidences themselves.
  assert trace_confidence(lp, window=2, lowest_frac=1.0) == pytest.approx(13.5 / 4)
  assert trace_confidence(lp, window=1, lowest_frac=0.4) == pytest.approx(1.5)
  # A trace shorter than the window is one group: the mean confidence (default window 2048).
  assert trace_confidence(lp) == pytest.approx(16 / 5)
  assert trace_confidence(lp[:1], window=3) == pytest.approx(1.0)  # a single token
  # 0.1 * 30 groups is 3.0000000000000004 in floats; still 3 groups, not 4.
  c = np.arange(32, dtype=float)
  assert trace_confidence(-c[:, None], window=3, lowest_frac=0.1) == pytest.approx(2.0)
  with pytest.raises(ValueError, match="empty trace"):
    trace_confidence(np.zeros((0, 2)))
  with pytest.raises(ValueError, match="non-finite"):
    trace_confidence(np.array([[-1.0, -np.inf]]))
  with pytest.raises(ValueError, match="window=0"):
    trace_confidence(lp, window=0)
  with pytest.raises(ValueError, match=r"shape \(5,\)"):
    trace_confidence(np.ones(5))


def test_weighted_maj_at_k_side_by_side():
  answers = [["1", "2", "2", "1"],  # majority tie -> "1"; head ranks "1"'s samples on top
             ["7", "8", "8", None]]
  rewards = [[1, 0, 0, 1],
             [0, 1, 1, 0]]
  head = [[0.9, -1.0, -0.5, 0.8],  # rank weights [1, 0, 1/3, 2/3]: "1" 5/3 vs "2" 1/3
          [2.0, 0.1, 0.2, 3.0]]  # ranks [2/3, 0, 1/3, 1]: "7" 2/3 vs "8" 1/3 (None skipped)
  assert maj_at_k(answers, rewards, 4) == 1.0  # prompt 0 "1" (tie, first) right; "8" right
  assert weighted_maj_at_k(answers, rewards, head, 4, rank=True) == 0.5  # "1" right, "7" wrong
  # Rank weights are recomputed on the first k samples: at k=2 both prompts rank [1, 0], so
  # "1" (right) and "7" (wrong) win.
  assert weighted_maj_at_k(answers, rewards, head, 2, rank=True) == 0.5
  # Raw weights (e.g. DeepConf confidences) are used as given.
  conf = [[1.0, 1.0, 1.5, 0.2], [0.1, 1.0, 1.0, 9.0]]
  assert weighted_maj_at_k(answers, rewards, conf, 4) == 0.5  # "2" (2.5) wrong, "8" right
  with pytest.raises(ValueError, match="prompt 0 has 4 answers, 3 weights"):
    weighted_maj_at_k(answers, rewards, [[1, 1, 1], [1, 1, 1, 1]], 2)
