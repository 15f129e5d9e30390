"""In-engine pruning (ARRoL's backend): detection points, quality-head logits computed inside
the decode step, group decisions, and pruned sequences leaving at once — dense and
block-sparse attention, with a LoRA sparse actor and under preemption."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.models.lora import LoRAConfig, init_lora
from sparrow_jax.models.quality_head import init_quality_head, quality_logits
from sparrow_jax.rl.arrol import detection_position
from sparrow_jax.schedule.presets import as_schedule
from sparrow_jax.schedule.schedule import teacher_forced_budgets

CFG = get_config("tiny", eos_token_ids=(), num_layers=3)
DETECT = 7
STOPS = frozenset(range(3, 120))  # ~1/4 of the vocabulary: several stops per window
NEW = 24


class EveryOtherPruner:
  """Prunes the 2nd, 4th, ... candidate of each group; logs every call."""

  def __init__(self, head, events):
    self.detect_len, self.stop_ids, self.head_params = DETECT, STOPS, head
    self.events, self.calls = events, []

  def decide(self, group, cands):
    keep = [i % 2 == 0 for i in range(len(cands))]
    self.calls.append((group, [c.request_id for c in cands], [c.logit for c in cands], keep))
    self.events.append(("decide", sum(not k for k in keep)))
    return keep


@pytest.fixture(scope="module")
def model():
  return init_model(CFG, seed=5)


def _requests():
  rng = np.random.default_rng(1)
  reqs = []
  for g in range(3):
    p = list(rng.integers(3, 500, int(rng.integers(5, 12))))
    reqs += [Request(p, SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=10 * g + j),
                     (g, j), group=g) for j in range(4)]
  return reqs


def _instrument(eng, events):
  prefill, decode = eng._prefill, eng._dispatch

  def p(run, admitted):
    events.append(("prefill", len(admitted)))
    return prefill(run, admitted)

  def d(*a, **k):
    events.append(("decode", 0))
    return decode(*a, **k)

  eng._prefill, eng._dispatch = p, d


_PAD = 64  # every reference forward at one padded length (max_seq_len): one compile per
# attention kind (causal, and a position's page selection reads only keys up to it, so the
# padding after `pos` changes nothing there)


@functools.partial(jax.jit, static_argnums=(0, 3, 6))
def _padded_hidden(graphdef, state, tokens, attention, lora, prompt_len, page):
  model = nnx.merge(graphdef, state)
  kw = {}
  if attention is not None:
    kw = dict(attention=attention, lora=lora, prompt_lengths=prompt_len,
              budgets=teacher_forced_budgets(as_schedule(attention.max_budget, page_size=page),
                                             tokens.shape[1], 1))
  return model.final_norm(model.hidden_states(tokens, **kw))[0]


def _hidden_at(model, tokens, pos, attention=None, lora=None, prompt_len=None, page=None):
  """Final-normed hidden state of a teacher-forced forward at position `pos`."""
  assert len(tokens) <= _PAD
  t = np.zeros((1, _PAD), np.int32)
  t[0, :len(tokens)] = tokens
  plen = jnp.asarray([prompt_len if prompt_len is not None else 0], jnp.int32)
  graphdef, state = nnx.split(model)
  return np.asarray(_padded_hidden(graphdef, state, jnp.asarray(t), attention, lora, plen,
                                   page))[pos]


CASES = {
    "dense": dict(attention=None, pages=None, lora=False),
    "sparse_lora_preempt": dict(attention=BlockSparse(max_budget=1, page_size=4,
                                                      dense_layers=(0,)),
                                pages=2 * 9 + 1, lora=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pruned_sequences_leave_at_once_and_others_are_unchanged(model, case):
  c = CASES[case]
  page = 4
  lora = None
  if c["lora"]:
    lora = init_lora(CFG, LoRAConfig(rank=2, alpha=4.0), jax.random.PRNGKey(1))
    lora = jax.tree.map(lambda x: x + 0.05 if x.ndim == 2 else x, lora)  # nonzero B
  ecfg = EngineConfig(num_slots=4, max_seq_len=64, page_size=page, decode_chunk=4,
                      num_pages=c["pages"])
  head = init_quality_head(jax.random.PRNGKey(3), CFG.hidden_size)
  events = []
  eng = GenerationEngine(model, ecfg, attention=c["attention"])
  _instrument(eng, events)
  pruner = EveryOtherPruner(head, events)
  reqs = _requests()
  outs = eng.generate(reqs, lora=lora, prune=pruner)
  base = GenerationEngine(model, ecfg, attention=c["attention"]).generate(reqs, lora=lora)
  st = eng.last_stats
  if c["pages"]:
    assert st["preemptions"] > 0, st
  assert len(pruner.calls) == 3  # one decision per group
  assert st["pruned"] == 6 and st["prune_candidates"] == 12
  assert st["pruned_running"] >= 1, st
  for r, o, b in zip(reqs, outs, base):
    if o.pruned and o.finish_reason == "pruned":
      # Pruned while running: the tokens so far are the unpruned run's prefix.
      assert DETECT < len(o.token_ids) < NEW
      np.testing.assert_array_equal(o.token_ids, b.token_ids[:len(o.token_ids)])
    else:
      # Kept, or pruned after it finished (its group's last member was still queued).
      np.testing.assert_array_equal(o.token_ids, b.token_ids)  # unchanged by others' pruning
      np.testing.assert_allclose(o.logprobs, b.logprobs, atol=1e-5)
    # The detection point is the last stop token among the first DETECT generated tokens.
    assert o.detect_index == detection_position(o.token_ids, STOPS, DETECT)
    seq = list(r.prompt_ids) + list(o.token_ids)
    h = _hidden_at(model, seq, len(r.prompt_ids) + o.detect_index, c["attention"], lora,
                   len(r.prompt_ids), page)
    np.testing.assert_allclose(o.detect_hidden, h, atol=2e-4)
    np.testing.assert_allclose(o.quality_logit, float(quality_logits(head, jnp.asarray(h))),
                               atol=2e-4)
  for group, ids, logits, keep in pruner.calls:
    by_id = {o.request_id: o for o in outs}
    assert [by_id[i].quality_logit for i in ids] == logits
    assert [not by_id[i].pruned for i in ids] == keep
  # A decision that pruned running sequences while requests were queued is followed by an
  # admission before the next decode chunk: the freed slots and pages are taken at once.
  first = next(i for i, e in enumerate(events) if e[0] == "decide" and e[1] > 0)
  after = [e[0] for e in events[first + 1:] if e[0] != "decide"]
  assert after[0] == "prefill", events
  assert all(a.num_used == 0 for a in eng.last_scheduler.allocators)


def test_sequences_that_finish_before_detection_are_kept(model):
  head = init_quality_head(jax.random.PRNGKey(3), CFG.hidden_size)
  pruner = EveryOtherPruner(head, [])
  reqs = [Request([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=n, seed=j), j,
                  group=0) for j, n in enumerate([3, 30, 30, 5])]
  outs = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=64, decode_chunk=4)
                          ).generate(reqs, prune=pruner)
  (_, ids, _, keep), = pruner.calls
  assert ids == [1, 2] and keep == [True, False]  # the short ones are not candidates
  assert [o.pruned for o in outs] == [False, False, True, False]
  # Finished before L_detect: its last *processed* stop token (the final token is never an
  # input), else the last processed token.
  for o in (outs[0], outs[3]):
    n = len(o.token_ids)
    assert o.detect_index == detection_position(o.token_ids[:-1], STOPS, n - 1)


class KeepAll:
  """Keeps every candidate; records what the engine decided on."""

  def __init__(self, head, detect_len):
    self.detect_len, self.stop_ids, self.head_params = detect_len, STOPS, head
    self.calls = {}

  def decide(self, group, cands):
    assert all(c.logit is not None for c in cands)  # every candidate was scored
    self.calls[group] = [(c.request_id, c.logit) for c in cands]
    return [True] * len(cands)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
def test_detection_point_does_not_move_under_preemption(model, temperature):
  # A readmission prefills the last generated token instead of decoding it: its detection
  # record must come from the prefill, or the point lands elsewhere (issue 19: 7 for 8).
  head = init_quality_head(jax.random.PRNGKey(3), CFG.hidden_size)
  reqs = [Request(r.prompt_ids, SamplingParams(temperature=temperature, max_new_tokens=NEW,
                                               seed=r.sampling.seed), r.request_id,
                  group=r.group) for r in _requests()]
  ecfg = lambda pages: EngineConfig(num_slots=4, max_seq_len=64, page_size=4, decode_chunk=4,
                                    num_pages=pages)
  engines = {p: GenerationEngine(model, ecfg(p)) for p in (None, 13, 19)}
  for detect_len in (1, 9):
    runs = {}
    for pages, eng in engines.items():
      hook = KeepAll(head, detect_len)
      runs[pages] = (eng.generate(reqs, prune=hook), hook.calls)
      assert (eng.last_stats["preemptions"] > 0) == (pages is not None), eng.last_stats
    ref, ref_calls = runs[None]
    for pages, (outs, calls) in runs.items():
      for r, o, b in zip(reqs, outs, ref):
        np.testing.assert_array_equal(o.token_ids, b.token_ids)
        assert o.detect_index == detection_position(o.token_ids, STOPS, detect_len), (
            pages, detect_len, r.request_id)
        np.testing.assert_allclose(o.detect_hidden, b.detect_hidden, atol=2e-5)
        np.testing.assert_allclose(o.quality_logit, b.quality_logit, atol=2e-5)
      assert calls.keys() == ref_calls.keys()
      for g in calls:  # the same candidates, scored the same: the same decisions
        assert [i for i, _ in calls[g]] == [i for i, _ in ref_calls[g]]
        np.testing.assert_allclose([x for _, x in calls[g]], [x for _, x in ref_calls[g]],
                                   atol=2e-5)
