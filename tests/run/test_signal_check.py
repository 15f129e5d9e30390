"""ZeroSignalCheck (issue 50): the first K steps without a learning signal are warned about
once, naming the reward, one response and the expected answer; zero-variance groups are
counted for the summary."""

import numpy as np
import pytest

from sparrow_jax.run.signal_check import ZeroSignalCheck

TEXTS = ["", "The answer is \\boxed{72}.", "72", "I don't know"]
GSM8K_ANSWER = "Natalia sold 48/2 = 24 clips in May. 48+24 = 72 altogether.\n#### 72"


def test_all_zero_warns_once_at_step_k():
  check = ZeroSignalCheck("exact_match", first_k=3)
  out = [check.observe(s, np.zeros(4), 2, TEXTS, [GSM8K_ANSWER] * 4) for s in (1, 2, 3, 4, 5)]
  assert out[0] is None and out[1] is None and out[3] is None and out[4] is None
  msg = out[2]
  assert msg.startswith("no learning signal: in the first 3 steps (to step 3) every "
                        "rollout scored 0 with reward=exact_match")
  assert "'The answer is \\\\boxed{72}.'" in msg  # the first non-empty response
  assert "48+24 = 72 altogether. #### 72'" in msg  # the expected answer, on one line
  assert "experiments/prepare_data.py" in msg
  assert check.summary() == {"zero_variance_groups": 10, "groups": 10}


def test_zero_variance_without_zeros_and_signal_cases():
  check = ZeroSignalCheck("boxed_exact", first_k=2)
  assert check.observe(1, [1, 1, 0, 0], 2, TEXTS, ["72"] * 4) is None
  msg = check.observe(2, [0, 0, 1, 1], 2, TEXTS, ["72"] * 4)
  assert "every group's rewards were equal (zero variance) with reward=boxed_exact" in msg
  # one group with signal in the first K steps: no warning, the flat groups still counted
  check = ZeroSignalCheck("boxed_exact", first_k=2)
  assert check.observe(1, [0, 0, 0, 0], 2, TEXTS, ["72"] * 4) is None
  assert check.observe(2, [0, 1, 0, 0], 2, TEXTS, ["72"] * 4) is None
  assert check.observe(3, [0, 0, 0, 0], 2, TEXTS, ["72"] * 4) is None
  assert check.summary() == {"zero_variance_groups": 5, "groups": 6} and not check.warned
  long = "x" * 500 + " so \\boxed{7}"
  check = ZeroSignalCheck("r", first_k=1)
  msg = check.observe(1, [0, 0], 2, [long, long], ["7", "7"])
  assert "'...xxx" in msg and "so \\\\boxed{7}'" in msg and len(msg) < 900


def test_groups_by_id():
  """Groups of different sizes (ARRoL prunes inside groups): by the rows' prompt ids."""
  check = ZeroSignalCheck("r", first_k=1)
  assert check.observe(1, [0, 1, 1, 0, 0], 0, ["a"] * 5, ["b"] * 5,
                       group_ids=[0, 0, 1, 2, 2]) is None
  assert check.summary() == {"zero_variance_groups": 2, "groups": 3}
  with pytest.raises(ValueError, match="2 group ids for 3 rewards"):
    check.observe(2, [0, 0, 0], 0, ["a"] * 3, ["b"] * 3, group_ids=[0, 1])


def test_bad_arguments():
  with pytest.raises(ValueError, match="first_k=0"):
    ZeroSignalCheck("r", first_k=0)
  check = ZeroSignalCheck("r")
  with pytest.raises(ValueError, match="group_size=3 does not divide the 4 rewards"):
    check.observe(1, [0] * 4, 3, ["a"] * 4, ["b"] * 4)
  with pytest.raises(ValueError, match="4 rewards, 2 responses"):
    check.observe(1, [0] * 4, 2, ["a"] * 2, ["b"] * 4)


def test_observe_step_reads_the_trainers_last_rollout():
  import types

  from sparrow_jax.rl.data import PromptExample
  from sparrow_jax.rl.tokenizers import ByteTokenizer
  from sparrow_jax.run.signal_check import METRIC, observe_step

  tok = ByteTokenizer()
  ex = [PromptExample("2+3=", "2+3=5\n#### 5"), PromptExample("1+1=", "#### 2")]
  comps = [types.SimpleNamespace(token_ids=tok.encode(t, add_bos=False), request_id=(i // 2, i))
           for i, t in enumerate(["5", "5", "", "2"])]
  tr = types.SimpleNamespace(step=1, tokenizer=tok, cfg=types.SimpleNamespace(group_size=2),
                             last_rollout=([ex[0], ex[0], ex[1], ex[1]], comps, [0.0] * 4))
  check = ZeroSignalCheck("exact_match", first_k=2)
  metrics = {}
  assert observe_step(check, tr, metrics) is None and metrics[METRIC] == 2
  tr.step = 2
  msg = observe_step(check, tr, metrics)
  assert "reward=exact_match" in msg and "One response: '5'" in msg
  assert "expected answer it was compared with: '2+3=5 #### 5'" in msg
  assert observe_step(check, types.SimpleNamespace(last_rollout=None), {}) is None


def test_five_step_run_on_raw_gsm8k_warns(tmp_path, capsys, caplog):
  """Acceptance (issue 50): a 5-step run on GSM8K-format data (answers are whole solutions
  ending `#### N`) with reward=exact_match scores 0 everywhere and says so once, with a
  response and the expected answer; the summary counts the zero-variance groups."""
  import json
  import logging

  import experiments.train as train_cli

  data = tmp_path / "gsm8k.jsonl"
  pairs = [(a, b) for a in range(1, 5) for b in range(1, 3)]
  data.write_text("".join(json.dumps({"question": f"{a}+{b}=",
                                      "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                          for a, b in pairs))
  with caplog.at_level(logging.WARNING):
    rc = train_cli.main([f"data={data}", "reward=exact_match", "num_steps=5",
                         "warmstart_steps=0", "prompts_per_step=4", "group_size=2",
                         "max_new_tokens=4", f"out_dir={tmp_path / 'run'}", "tensorboard=false",
                         "--quiet"])
  out = capsys.readouterr()
  assert rc == 0, out.err[-2000:]
  text = out.err + "\n".join(r.getMessage() for r in caplog.records)
  assert text.count("no learning signal: in the first") == 1, text[-3000:]
  assert ("in the first 5 steps (to step 5) every rollout scored 0 with reward=exact_match"
          in text)
  assert "expected answer it was compared with: '" in text and " #### " in text
  assert "One response: '" in text
  assert "zero_variance_groups=20" in out.out  # 5 steps x 4 groups, all flat
