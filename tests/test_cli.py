"""Command-line entry points: generate (dense and block-sparse) and the cost model."""

import experiments.cost_model as cost_cli
import experiments.generate as gen_cli


def test_generate_dense_and_sparse(capsys):
  assert gen_cli.main(["--prompt", "12+7=", "--prompt", "abc", "--max-new-tokens", "5"]) == 0
  out = capsys.readouterr().out
  assert out.count("--- prompt") == 2 and "finish=length" in out
  assert gen_cli.main(["--prompt", "Compute 12+7 and put the answer in a box.",
                       "--max-new-tokens", "6", "--sparse-budget", "1", "--page-size", "4"]) == 0
  assert "finish=length" in capsys.readouterr().out


def test_generate_bad_input_exits_2(capsys):
  assert gen_cli.main(["--prompt", "x", "--schedule", "nope"]) == 2
  assert "not understood" in capsys.readouterr().err
  assert gen_cli.main(["--config", "qwen3_1p7b", "--prompt", "x"]) == 2
  assert gen_cli.main(["--prompt", "x", "--model-path", "/does/not/exist.gguf"]) == 2


def test_cost_model_cli(capsys):
  assert cost_cli.main(["--config", "qwen3_1p7b", "--schedule", "qwen3-1.7b-0.86",
                        "--gen-len", "32768", "--json"]) == 0
  assert "speedup" in capsys.readouterr().out
