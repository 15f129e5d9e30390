"""experiments/task_precheck.py on the tiny preset: it samples, scores three ways, prints the
fractions and samples; a bad key is refused before any model is built."""

import re

import experiments.task_precheck as precheck


def test_precheck_scores_samples_three_ways(capsys):
  assert precheck.main(["--config", "tiny", "--prompts", "3", "--k", "2", "--show", "2",
                        "warmstart_steps=0", "num_slots=8"]) == 0
  out = capsys.readouterr().out
  assert "6 samples (3 prompts x 2)" in out, out
  m = re.search(r"boxed_exact ([\d.]+)  has a box ([\d.]+)  boxed_or_last_number ([\d.]+)  "
                r"mean length (\d+) tokens", out)
  assert m, out
  assert all(0.0 <= float(v) <= 1.0 for v in m.groups()[:3])
  assert 1 <= int(m.group(4)) <= 4  # the tiny preset's max_new_tokens
  assert out.count("  --- ") == 2


def test_precheck_refuses_a_bad_key(capsys):
  assert precheck.main(["--config", "tiny", "num_step=3"]) == 2
  assert "num_steps" in capsys.readouterr().err
