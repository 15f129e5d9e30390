"""Tests of the eFLOP / bytes / roofline cost model against hand computations."""

import contextlib
import importlib.util
import io
import json
import os
import tempfile

import chex
import numpy as np
import pytest

from sparrow_jax.models.config import ModelConfig, get_config
from sparrow_jax.schedule import cost_model as cm
from sparrow_jax.schedule import presets
from sparrow_jax.schedule.schedule import SparsitySchedule

# Small model: h=8, I=12, N=3 layers, H=4 query heads, Kv=2 KV heads, head_dim 4, vocab 10.
SMALL = ModelConfig(name="small", vocab_size=10, hidden_size=8, intermediate_size=12,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=4,
                    tie_word_embeddings=True)
# page 4, bins of 8 tokens, budgets (1, 2), 1 bos + 1 recent reserved, layer 0 dense.
SCHED = SparsitySchedule(name="small", page_size=4, bin_size=8, budgets=(1, 2), reserved_bos=1,
                         reserved_recent=1, dense_layers=(0,), tau=None)
# Hand numbers:
#   matmul params per layer: qkv 8*4*(4+2*2)=256, o 4*4*8=128, mlp 3*8*12=288 -> 672;
#   3 layers 2016 + LM head 10*8=80 -> P = 2096, linear eFLOPs 2P = 4192.
#   D = 2*4 = 8, G = 2, r = 4G = 8 -> r*D = 64 per layer per attended token. N_d = 1, N_s = 2.
#   weights read: num_params(no emb) = 3*(256+128+2*4 qk-norm+288+2*8 norms)+8 = 2096,
#   + LM head 80 = 2176 params = 4352 bytes.
P2 = 4192
W_BYTES = 4352
# Positions 29, 30, 31 (bin 3 -> clamped to 1, budget 2, pages attended 4, 8 pages held):
#   m = n - (8 - 4) * 4 = n - 16 tokens per sparse layer; 29 // 4 = 7 full pages scored.
SPARSE_FLOPS = {29: P2 + 64 * (29 + 2 * 13) + 2 * 8 * 2 * 7 + 1 * 2 * 2 * 7,   # 7964
                30: P2 + 64 * (30 + 2 * 14) + 224 + 28,                        # 8156
                31: P2 + 64 * (31 + 2 * 15) + 224 + 28}                        # 8348
#   bytes: KV 2 bytes * 2 (K,V) * 8 * (n + 2 m) + float32 landmarks 4*8*2*7 = 448
#   + KV write 2*2*8*3 = 96
SPARSE_BYTES = {29: 32 * 55 + 448 + 96, 30: 32 * 58 + 448 + 96, 31: 32 * 61 + 448 + 96}
DENSE_FLOPS = {n: P2 + 64 * 3 * n for n in (29, 30, 31)}
DENSE_BYTES = {n: 32 * 3 * n + 96 for n in (29, 30, 31)}


class PerTokenTest(chex.TestCase):

  def test_counts(self):
    assert cm.matmul_params(SMALL) == 2096
    assert cm.matmul_params(SMALL, include_lm_head=False) == 2016
    assert cm.weight_bytes(SMALL, cm.GPUSpec()) == W_BYTES
    assert cm.attention_r(SMALL) == 8

  def test_hand_computation(self):
    assert SPARSE_FLOPS == {29: 7964, 30: 8156, 31: 8348}
    c = cm.per_token_cost(SMALL, SCHED, [29, 30, 31])
    np.testing.assert_array_equal(c["tokens_attended"], [13, 14, 15])
    np.testing.assert_array_equal(c["pages_scored"], [7, 7, 7])
    np.testing.assert_array_equal(c["flops"], [SPARSE_FLOPS[n] for n in (29, 30, 31)])
    np.testing.assert_array_equal(c["bytes"], [SPARSE_BYTES[n] for n in (29, 30, 31)])
    np.testing.assert_array_equal(c["flops_topk"], [28, 28, 28])
    d = cm.per_token_cost(SMALL, presets.dense(page_size=4), [29, 30, 31])
    np.testing.assert_array_equal(d["flops"], [DENSE_FLOPS[n] for n in (29, 30, 31)])
    np.testing.assert_array_equal(d["bytes"], [DENSE_BYTES[n] for n in (29, 30, 31)])
    np.testing.assert_array_equal(d["flops_landmark"], [0, 0, 0])

  def test_within_budget_is_dense(self):
    # n = 13: 4 pages held <= budget 2 + 2 reserved: dense, nothing scored.
    c = cm.per_token_cost(SMALL, SCHED, [13])
    assert c["tokens_attended"][0] == 13 and c["pages_scored"][0] == 0
    assert c["flops"][0] == P2 + 64 * 3 * 13

  def test_quest_and_options(self):
    q = SCHED.replace(landmark="quest")
    c = cm.per_token_cost(SMALL, q, [30], topk_ops_per_candidate=3.0, include_lm_head=False)
    # quest: 4 FLOPs per channel per page, min and max stored (2 vectors)
    assert c["flops_landmark"][0] == 4 * 8 * 2 * 7
    assert c["landmark_bytes"][0] == 4 * 2 * 8 * 2 * 7  # float32 landmarks
    bf16 = cm.per_token_cost(SMALL, q, [30], gpu=cm.GPUSpec(landmark_bytes_per_element=2))
    assert bf16["landmark_bytes"][0] == 2 * 2 * 8 * 2 * 7
    assert c["bytes"][0] - bf16["bytes"][0] == 2 * 2 * 8 * 2 * 7
    assert c["flops_topk"][0] == 3 * 2 * 2 * 7
    assert c["flops_linear"][0] == 2 * 2016
    with pytest.raises(ValueError, match="positions min=0"):
      cm.per_token_cost(SMALL, SCHED, [0, 5])


class RolloutTest(chex.TestCase):

  def test_hand_computation(self):
    gpu = cm.GPUSpec(mem_bandwidth=1000.0, peak_flops=2000.0)
    kw = dict(prompt_len=28, gen_len=3, batch=2, gpu=gpu)
    s = cm.rollout_cost(SMALL, SCHED, **kw)
    d = cm.rollout_cost(SMALL, presets.dense(page_size=4), **kw)
    ns = (29, 30, 31)
    assert s.flops == 2 * sum(SPARSE_FLOPS[n] for n in ns) == 48936
    assert s.bytes == sum(W_BYTES + 2 * SPARSE_BYTES[n] for n in ns) == 27456
    assert d.bytes == sum(W_BYTES + 2 * DENSE_BYTES[n] for n in ns) == 30912
    assert s.bytes_by_part["weights"] == 3 * W_BYTES
    # every step memory-bound: bytes / 1000 > flops / 2000
    np.testing.assert_allclose(s.decode_time_s, 27.456, rtol=1e-12)
    np.testing.assert_allclose(d.decode_time_s, 30.912, rtol=1e-12)
    assert s.memory_bound_steps == 1.0
    # prefill (dense, compute-bound): 2 * (2P*28 + r*D*N*28*29/2) = 390656 FLOPs / 2000
    np.testing.assert_allclose(s.prefill_time_s, 195.328, rtol=1e-12)
    assert d.prefill_time_s == s.prefill_time_s
    sp = cm.rollout_speedup(SMALL, SCHED, **kw)
    np.testing.assert_allclose(sp["time_speedup"], (195.328 + 30.912) / (195.328 + 27.456),
                               rtol=1e-12)
    np.testing.assert_allclose(sp["eflops_ratio"], 2 * sum(DENSE_FLOPS.values()) / 48936,
                               rtol=1e-12)
    np.testing.assert_allclose(s.tokens_per_s, 6 / s.time_s)

  def test_compute_bound_steps(self):
    gpu = cm.GPUSpec(mem_bandwidth=1e9, peak_flops=10.0)
    s = cm.rollout_cost(SMALL, SCHED, prompt_len=28, gen_len=3, batch=2, gpu=gpu,
                        include_prefill=False)
    assert s.memory_bound_steps == 0.0 and s.prefill_time_s == 0.0
    np.testing.assert_allclose(s.decode_time_s, 48936 / 10.0, rtol=1e-12)

  def test_dense_closed_form(self):
    # sum_t 2P + r D N n over n = L_in+1 .. L_in+L = 2P L + rDN (L L_in + L (L + 1) / 2)
    cfg = get_config("qwen3_1p7b")
    li, lg, b = 300, 1000, 4
    d = cm.rollout_cost(cfg, presets.dense(), prompt_len=li, gen_len=lg, batch=b)
    p, r = cm.matmul_params(cfg), 4 * cfg.num_heads // cfg.num_kv_heads
    want = b * (2 * p * lg + r * cfg.kv_width * cfg.num_layers * (lg * li + lg * (lg + 1) / 2))
    np.testing.assert_allclose(d.flops, want, rtol=1e-12)

  def test_speedups(self):
    cfg = get_config("qwen3_1p7b")
    kw = dict(prompt_len=512, gen_len=32768, batch=64)
    assert cm.rollout_speedup(cfg, presets.dense(), **kw)["time_speedup"] == 1.0
    big = presets.constant(10_000)  # budget covers every page: attention stays dense
    np.testing.assert_allclose(cm.rollout_speedup(cfg, big, **kw)["time_speedup"], 1.0,
                               rtol=1e-12)
    short = cm.rollout_speedup(cfg, presets.get_schedule("qwen3-1.7b-0.86"), prompt_len=100,
                               gen_len=100, batch=64)
    assert short["time_speedup"] == 1.0  # 200 tokens fit in 29 + 3 pages
    sp = {t: cm.rollout_speedup(cfg, presets.get_schedule(f"qwen3-1.7b-{t}"), **kw)
          for t in ("0.75", "0.86", "0.94")}
    assert sp["0.86"]["time_speedup"] > 2.0 and sp["0.86"]["eflops_ratio"] > 1.2
    assert sp["0.75"]["time_speedup"] > sp["0.86"]["time_speedup"] > sp["0.94"]["time_speedup"]
    one = cm.rollout_speedup(cfg, presets.get_schedule("qwen3-1.7b-0.86"), prompt_len=512,
                             gen_len=32768, batch=1)
    assert 1.0 < one["time_speedup"] < sp["0.86"]["time_speedup"]  # weights dominate at B=1

  def test_errors(self):
    with pytest.raises(ValueError, match="gen_len=0"):
      cm.rollout_cost(SMALL, SCHED, prompt_len=1, gen_len=0, batch=1)
    with pytest.raises(ValueError, match="batch=0"):
      cm.rollout_cost(SMALL, SCHED, prompt_len=1, gen_len=2, batch=0)
    with pytest.raises(ValueError, match="mem_bandwidth=0"):
      cm.GPUSpec(mem_bandwidth=0)
    with pytest.raises(ValueError, match="bytes_per_element"):
      cm.GPUSpec(bytes_per_element=1.5)
    with pytest.raises(ValueError, match="landmark_bytes_per_element"):
      cm.GPUSpec(landmark_bytes_per_element=0)


class PageSizeTest(chex.TestCase):

  TABLE = {  # (page_size, bin, budget pages) -> p5
      (16, 0, 8): 0.90, (16, 0, 16): 0.95, (16, 1, 8): 0.80, (16, 1, 16): 0.88,
      (64, 0, 2): 0.70, (64, 0, 4): 0.87, (64, 1, 2): 0.60, (64, 1, 4): 0.80,
  }

  def test_compare(self):
    cfg = get_config("qwen3_1p7b")
    rows = cm.compare_page_sizes(cfg, self.TABLE, tau=0.86, bin_size=2048, prompt_len=512,
                                 gen_len=8192, batch=16)
    assert [r["page_size"] for r in rows] == [16, 64]
    assert rows[0]["budgets"] == [8, 16] and rows[0]["all_bins_feasible"]
    assert rows[1]["budgets"] == [4, 4] and not rows[1]["all_bins_feasible"]
    assert rows[0]["tokens_max"] == (16 + 3) * 16
    sched = SparsitySchedule(page_size=16, bin_size=2048, budgets=(8, 16), tau=0.86)
    want = cm.rollout_speedup(cfg, sched, prompt_len=512, gen_len=8192, batch=16)
    np.testing.assert_allclose(rows[0]["time_speedup"], want["time_speedup"], rtol=1e-12)

  def test_csv(self):
    with tempfile.TemporaryDirectory() as d:
      p = os.path.join(d, "p5.csv")
      with open(p, "w") as f:
        f.write("page_size,bin,budget,p5,extra\n")
        for (ps, b, k), v in self.TABLE.items():
          f.write(f"{ps},{b},{k},{v},x\n")
      assert cm.load_alpha_table(p) == self.TABLE
      with open(p, "w") as f:
        f.write("page_size,bin,p5\n16,0,0.9\n")
      with pytest.raises(ValueError, match="p5.csv.*expected columns"):
        cm.load_alpha_table(p)
      with open(p, "w") as f:
        f.write("page_size,bin,budget,p5\n16,zero,8,0.9\n")
      with pytest.raises(ValueError, match="p5.csv. line 2"):
        cm.load_alpha_table(p)


def _load_cli():
  path = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "cost_model.py")
  spec = importlib.util.spec_from_file_location("cost_model_cli", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _run(cli, argv):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      rc = cli.main(argv)
    except SystemExit as e:
      rc = e.code
  return rc, out.getvalue(), err.getvalue()


class CliTest(chex.TestCase):

  def test_json_and_table(self):
    cli = _load_cli()
    rc, out, _ = _run(cli, ["--config", "qwen3_1p7b", "--schedule", "qwen3-1.7b-0.86",
                            "--prompt-len", "512", "--gen-len", "4096", "--batch", "8",
                            "--json"])
    assert rc == 0
    res = json.loads(out)
    want = cm.rollout_speedup(get_config("qwen3_1p7b"), presets.get_schedule("qwen3-1.7b-0.86"),
                              prompt_len=512, gen_len=4096, batch=8)
    np.testing.assert_allclose(res["time_speedup"], want["time_speedup"], rtol=1e-12)
    rc, out, _ = _run(cli, ["--gen-len", "4096", "--batch", "8"])
    assert rc == 0 and "predicted rollout speedup" in out and "kv_read" in out

  def test_paper_table(self):
    rc, out, _ = _run(_load_cli(), ["--paper-table", "--gen-len", "2048", "--batches", "1,64"])
    assert rc == 0
    for name, fig in (("qwen3_1p7b", "2.21x"), ("qwen3_4b", "2.41x"), ("qwen3_8b", "2.06x"),
                      ("qwen3_14b", "1.48x")):
      assert any(name in line and fig in line for line in out.splitlines()), name

  def test_bad_args_exit_2(self):
    cli = _load_cli()
    for argv, msg in ((["--batch", "0"], "--batch"), (["--schedule", "bogus"], "constant:K"),
                      (["--config", "nope"], "nope"), (["--prompt-len", "-1"], "--prompt-len"),
                      (["--tau", "1.5"], "--tau"), (["--gpu-bw", "x"], "--gpu-bw"),
                      (["--alpha-table", "/no/such.csv"], "does not exist")):
      rc, _, err = _run(cli, argv)
      assert rc == 2, argv
      assert msg in err, (argv, err)
