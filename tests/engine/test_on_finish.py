"""`GenerationEngine.generate(on_finish=...)`: every request reported exactly once, with the
completion `generate` returns, as soon as its decode chunk ends (callers such as the
calibration journal save work while the rest still runs)."""

import numpy as np

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model


def test_on_finish_reports_each_request_once_as_it_finishes():
  cfg = get_config("tiny", eos_token_ids=())  # no EOS: lengths follow max_new_tokens
  model = init_model(cfg, seed=3)
  rng = np.random.default_rng(0)
  lengths = [2, 24, 3, 24, 4]  # short ones finish chunks before the long ones
  reqs = [Request(list(rng.integers(3, cfg.vocab_size, 5)),
                  SamplingParams(temperature=1.0, max_new_tokens=n, seed=i), i)
          for i, n in enumerate(lengths)]
  eng = GenerationEngine(model, EngineConfig(num_slots=2, max_seq_len=64, decode_chunk=4))
  calls, events = [], []

  def on_finish(i, c):
    calls.append((i, c))
    events.append(("finished", i))

  outs = eng.generate(reqs, on_finish=on_finish,
                      progress=lambda done, total: events.append(("chunk", done)))
  assert sorted(i for i, _ in calls) == list(range(len(reqs)))  # each once
  assert all(c is outs[i] for i, c in calls)  # the very completions returned
  assert [len(outs[i].token_ids) for i in range(len(reqs))] == lengths
  # Requests 0 and 2 (2 and 3 tokens) were reported while long ones were still decoding,
  # with decode chunks still to come.
  last_chunk = max(k for k, e in enumerate(events) if e[0] == "chunk")
  first_long = min(k for k, e in enumerate(events)
                   if e[0] == "finished" and lengths[e[1]] == 24)
  for i in (0, 2):
    assert events.index(("finished", i)) < min(first_long, last_chunk), events
  assert len(eng.generate(reqs[:1])[0].token_ids) == 2  # the hook is optional
