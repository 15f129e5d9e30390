"""Tests for sparrow_jax.run.memory: exact parameter bytes, optimizer/LoRA/KV arithmetic against
independent counts, and the fit / no-fit verdicts for the large presets."""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import Decoder
from sparrow_jax.models.kv_cache import PagedKVCache
from sparrow_jax.run import memory as M
from sparrow_jax.run import sharding as sh

SMALL = dict(batch_slots=8, context_len=256, train_micro_batch=4, train_seq_len=128)


def _norm_params(cfg):
  """Replicated leaves under PARAM_RULES: the RMSNorm scales."""
  per_layer = 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)
  return cfg.num_layers * per_layer + cfg.hidden_size


@pytest.mark.parametrize("name,overrides", [
    ("tiny", {}), ("qwen3_8b", {"num_layers": 3}),
    ("tiny", {"attention_bias": True, "qk_norm": False, "tie_word_embeddings": False})])
def test_abstract_params_equals_full_eval_shape(name, overrides):
  cfg = get_config(name, **overrides)
  full = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))[1].to_pure_dict()
  fast = M.abstract_params(cfg)
  assert jax.tree.structure(full) == jax.tree.structure(fast)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(fast)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)


@pytest.mark.parametrize("name,dtype", [("tiny", "float32"), ("smollm2_135m", "bfloat16"),
                                        ("qwen3_1p7b", "bfloat16"), ("qwen3_8b", "float32")])
def test_param_bytes_are_exact(name, dtype):
  cfg = get_config(name)
  item = np.dtype(jnp.dtype(dtype)).itemsize
  plan = M.plan_memory(cfg, "1x1x1", param_dtype=dtype, **SMALL)
  assert plan.param_count == cfg.num_params()
  assert plan.param_bytes_total == cfg.num_params() * item
  assert plan["params"] == plan.param_bytes_total  # one device holds everything
  assert plan["grads"] == plan["params"]


def test_param_bytes_per_device_on_32_devices():
  cfg = get_config("qwen3_14b")
  plan = M.plan_memory(cfg, "fsdp=-1", num_devices=32, param_dtype="bfloat16", **SMALL)
  norms = _norm_params(cfg)
  matrices = cfg.num_params() - norms
  assert matrices % 32 == 0  # every matrix's D divides 32: all split exactly
  assert plan["params"] == (matrices // 32 + norms) * 2
  assert plan["params"] * 32 >= plan.param_bytes_total == cfg.num_params() * 2
  # Tensor parallelism on top: heads/F/V also split; still exact.
  plan2 = M.plan_memory(cfg, "1x8x4", param_dtype="bfloat16", **SMALL)
  assert plan2["params"] == (matrices // 32 + norms) * 2
  assert plan2.fallbacks == ()


def test_optimizer_bytes():
  cfg = get_config("qwen3_1p7b")
  n = cfg.num_params()
  bf16 = M.plan_memory(cfg, "1x1x1", param_dtype="bfloat16", **SMALL)
  assert bf16["optimizer"] == 3 * n * 4 + 4  # mu, nu, float32 master copy, step count
  f32 = M.plan_memory(cfg, "1x1x1", param_dtype="float32", **SMALL)
  assert f32["optimizer"] == 2 * n * 4 + 4
  sgd = M.plan_memory(cfg, "1x1x1", param_dtype="float32", optimizer="sgd", **SMALL)
  assert sgd["optimizer"] == 0
  ref = M.plan_memory(cfg, "1x1x1", param_dtype="bfloat16", reference_model=True, **SMALL)
  assert ref["reference"] == n * 2


def test_lora_bytes():
  cfg = get_config("qwen3_0p6b")
  r, d, nh, k, h, f = 16, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, \
      cfg.intermediate_size
  per_layer = (d * r + r * nh * h) + (d * r + r * k * h) + (nh * h * r + r * d) \
      + 2 * (d * r + r * f) + (f * r + r * d) + 6  # q, v, o, gate, up, down + 6 scales
  n = cfg.num_layers * per_layer
  plan = M.plan_memory(cfg, "1x1x1", lora_rank=r,
                       lora_targets=("q", "v", "o", "gate", "up", "down"), **SMALL)
  assert plan["lora"] == 4 * n * 4  # float32 factors + grads + 2 float32 moments
  sharded = M.plan_memory(cfg, "1x4x2", lora_rank=r,
                          lora_targets=("q", "v", "o", "gate", "up", "down"), **SMALL)
  # fsdp=4 splits the D side of each factor, tensor=2 its heads/F side (the rank never).
  per_layer_dev = (d * r // 4 + r * nh * h // 2) + (d * r // 4 + r * k * h // 2) \
      + (nh * h * r // 2 + r * d // 4) + 2 * (d * r // 4 + r * f // 2) \
      + (f * r // 2 + r * d // 4) + 6
  assert sharded["lora"] == 4 * cfg.num_layers * per_layer_dev * 4


@pytest.mark.parametrize("landmark_dtype", ["float32", "bfloat16"])
def test_page_bytes_follow_the_landmark_dtype(landmark_dtype):
  """bf16 landmarks: the page formula, the cache the engine allocates and the plan agree."""
  cfg = get_config("tiny")
  kw = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            page_size=16, dtype="bfloat16", landmark="quest")
  per_page = M.kv_bytes_per_page(**kw, landmark_dtype=landmark_dtype)
  lm_item = 4 if landmark_dtype == "float32" else 2
  kv = 2 * cfg.num_kv_heads * 16 * cfg.head_dim * 2
  assert per_page == cfg.num_layers * (kv + 2 * cfg.num_kv_heads * cfg.head_dim * lm_item)
  cache = jax.eval_shape(lambda: PagedKVCache.create(
      num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      num_slots=1, num_pages=10, max_pages_per_seq=1, page_size=16, dtype=jnp.bfloat16,
      landmark="quest", landmark_dtype=landmark_dtype))
  assert {x.dtype for x in jax.tree.leaves(cache.landmarks)} == {jnp.dtype(landmark_dtype)}
  assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      (cache.k, cache.v, cache.landmarks))) == 10 * per_page
  plan = M.plan_memory(cfg, "1x1x1", batch_slots=8, context_len=100, page_size=16,
                       train_micro_batch=2, train_seq_len=64, landmark="quest",
                       cache_dtype="bfloat16", landmark_dtype=landmark_dtype)
  assert plan.kv_bytes_per_page == per_page
  with pytest.raises(ValueError, match="landmark_dtype='float16'"):
    M.kv_bytes_per_page(**kw, landmark_dtype="float16")


def test_kv_pool_is_sized_from_what_is_left_in_whole_pages():
  cfg = get_config("tiny")
  per_page = M.kv_bytes_per_page(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, page_size=16, dtype="bfloat16",
                                 landmark="quest")
  # The formula is what the engine's cache allocates per page (K, V, 2 landmarks per layer).
  cache = jax.eval_shape(lambda: PagedKVCache.create(
      num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      num_slots=1, num_pages=10, max_pages_per_seq=1, page_size=16, dtype=jnp.bfloat16,
      landmark="quest"))
  pool = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v,
                                                                 cache.landmarks)))
  assert pool == 10 * per_page
  kw = dict(batch_slots=8, context_len=100, page_size=16, train_micro_batch=2,
            train_seq_len=64, landmark="quest", cache_dtype="bfloat16")
  tables = 8 * (math.ceil(100 / 16) * 4 + 4)
  # Explicit bytes: whole pages of them.
  plan = M.plan_memory(cfg, "1x1x1", kv_cache_bytes=5 * per_page + 7, **kw)
  assert plan.kv_pool_pages == 5 and plan["kv_cache"] == 5 * per_page + tables
  assert plan.kv_cache_bytes == 5 * per_page
  # From memory: kv_cache_fraction of what the rollout phase leaves of the usable memory
  # (the training state stays, the engine's weights and one step's work come on top).
  dev = 11e6  # leaves room for ~36 pages: below the cap, above one sequence
  plan = M.plan_memory(cfg, "1x1x1", device_bytes=dev, kv_cache_fraction=0.1, **kw)
  decode = plan.phase("rollout_decode")
  assert plan.pool_room < 0.9 * dev - decode.resident
  assert plan.kv_pool_pages == int(plan.pool_room * 0.1) // per_page
  assert decode.resident == plan["params"] + plan["optimizer"]  # tiny: no reference, no LoRA
  assert 8 < plan.kv_pool_pages < 57 and plan.fits
  # The pool lives only while rolling out: the training phases do not hold it...
  assert plan.phase("update").resident == plan["optimizer"]
  # ... unless release_kv_cache=False, which then must fit beside every training phase.
  held = M.plan_memory(cfg, "1x1x1", device_bytes=dev, kv_cache_fraction=0.1,
                       release_kv_cache=False, **kw)
  assert held.kv_pool_pages <= plan.kv_pool_pages
  assert held.phase("update").resident == held["optimizer"] + held["kv_cache"]
  # Capped at every slot holding the whole context (+ the null page) on a big device.
  big = M.plan_memory(cfg, "1x1x1", **kw)
  assert big.kv_pool_pages == 8 * math.ceil(100 / 16) + 1
  assert big.concurrency["at_max"] == 8 and big.concurrency["at_mean"] == 8
  # Too little memory for one sequence of the maximum length: does not fit, says why.
  tiny = M.plan_memory(cfg, "1x1x1", kv_cache_bytes=3 * per_page, **kw)
  assert not tiny.fits and "one sequence of the maximum length" in tiny.message()


def test_concurrency_counts_whole_sequences():
  cfg = get_config("tiny")
  per_page = M.kv_bytes_per_page(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                 head_dim=cfg.head_dim, page_size=16, dtype="float32",
                                 landmark="mean")
  plan = M.plan_memory(cfg, "1x1x1", batch_slots=64, context_len=1024, page_size=16,
                       train_micro_batch=2, train_seq_len=64, mean_context_len=300,
                       kv_cache_bytes=201 * per_page)
  assert plan.concurrency == {"max_len": 1024, "mean_len": 300, "at_max": 200 // 64,
                              "at_mean": 200 // 19}


def test_activation_estimate_definition():
  cfg = get_config("tiny")  # D=64, N=4, K=2, H=32, F=128, V=512, L=2; float32
  b, t = 2, 128
  kw = dict(batch_slots=1, context_len=16, train_seq_len=t)
  plan = M.plan_memory(cfg, "1x1x1", train_micro_batch=b, **kw)
  no_remat = M.plan_memory(cfg, "1x1x1", train_micro_batch=b, remat=False, **kw)
  # With remat only each layer's input is kept; without it, its activations (e per token).
  e_layer = 4 * 64 + 2 * 4 * 32 + 2 * 2 * 32 + 3 * 128
  assert no_remat["activations"] - plan["activations"] == pytest.approx(
      b * t * 2 * (M._SIGMA_NO_REMAT * e_layer - 64) * 4, abs=2)
  # The update phase holds params, their gradient accumulator and gradients beside them.
  upd = plan.phase("update")
  assert upd.program == 3 * plan["params"] + plan["activations"]
  assert upd.resident == plan["optimizer"]
  # The micro-batch is split over data x fsdp (an LM-head chunk spans all rows: 128 tokens
  # of 4 rows = 32 positions, one row's share on each device); fsdp also splits the stacked
  # layer weights.
  split = M.plan_memory(cfg, "4x1x1", train_micro_batch=4, **kw)
  assert split["activations"] == M.plan_memory(cfg, "1x1x1", train_micro_batch=1,
                                               logits_chunk=32, **kw)["activations"]
  assert M.plan_memory(cfg, "1x4x1", train_micro_batch=4, **kw)["activations"] < \
      split["activations"]
  # More rows or longer rows: more activations; bf16 activations: fewer than float32.
  assert M.plan_memory(cfg, "1x1x1", train_micro_batch=4, **kw)["activations"] > \
      plan["activations"]
  bf16 = M.plan_memory(cfg, "1x1x1", train_micro_batch=b, activation_dtype="bfloat16", **kw)
  assert bf16["activations"] < plan["activations"]


def test_qwen3_14b_on_32_devices_fits_quickly():
  t0 = time.perf_counter()
  plan = M.plan_memory(get_config("qwen3_14b"), "fsdp=-1", num_devices=32, batch_slots=256,
                       context_len=8192, train_micro_batch=32, train_seq_len=8192,
                       param_dtype="bfloat16", compute_dtype="bfloat16", lora_rank=64,
                       lora_targets=M.LORA_TARGETS, max_prefill_tokens=32768)
  elapsed = time.perf_counter() - t0
  assert elapsed < 10.0, elapsed
  assert plan.fits and plan.headroom > 0
  # Prefilling all 256 slots' prompts in one call would not (2M tokens of activations).
  whole = M.plan_memory(get_config("qwen3_14b"), "fsdp=-1", num_devices=32, batch_slots=256,
                        context_len=8192, train_micro_batch=32, train_seq_len=8192,
                        param_dtype="bfloat16", compute_dtype="bfloat16", lora_rank=64,
                        lora_targets=M.LORA_TARGETS)
  assert not whole.fits and whole.peak_phase.name == "rollout_prefill"
  assert "max_prefill_tokens=" in whole.message()
  assert plan.mesh.shape == (1, 32, 1) and plan.num_devices == 32
  table = plan.format_table()
  for row in ("params", "grads", "optimizer", "lora", "kv_cache", "activations",
              "fsdp_buffers", "total", "headroom", "fits"):
    assert row in table
  assert plan.to_dict()["fits"] is True
  # The phases never overlap: the step peaks at its largest one.
  assert plan.total == max(p["total"] for p in plan.to_dict()["phases"].values())
  assert plan.total == plan.peak_phase.total


def test_qwen3_32b_on_one_device_does_not_fit():
  plan = M.plan_memory(get_config("qwen3_32b"), "1x1x1", batch_slots=64, context_len=8192,
                       train_micro_batch=8, train_seq_len=8192, param_dtype="bfloat16")
  assert not plan.fits and plan.headroom < 0
  msg = plan.message()
  assert "qwen3_32b on 1 device(s)" in msg and "does not fit" in msg
  assert "optimizer" in msg  # the largest item is named
  assert "DOES NOT FIT" in plan.format_table()
  assert plan["params"] == get_config("qwen3_32b").num_params() * 2


def test_fallbacks_are_reported():
  plan = M.plan_memory(get_config("smollm2_135m"), "1x2x2", **SMALL)
  assert any("q_DNH dim 1 (size 9) not divisible by tensor=2" in f for f in plan.fallbacks)
  assert "fallback:" in plan.format_table()


@pytest.mark.parametrize("kw,needle", [
    (dict(optimizer="lion"), "optimizer='lion'"),
    (dict(lora_rank=8), "expected rank >= 0 and targets"),
    (dict(lora_rank=8, lora_targets=("qkv",)), "unknown \\['qkv'\\]"),
    (dict(batch_slots=0), "batch_slots=0"),
    (dict(landmark="max"), "landmark='max'"),
    (dict(usable_fraction=1.5), "usable_fraction"),
])
def test_plan_validation(kw, needle):
  args = {**SMALL, **kw}
  with pytest.raises(ValueError, match=needle):
    M.plan_memory(get_config("tiny"), "1x1x1", **args)


def test_plan_mesh_errors():
  with pytest.raises(ValueError, match="pass num_devices"):
    M.plan_memory(get_config("tiny"), "fsdp=-1", **SMALL)
  with pytest.raises(ValueError, match="product of the axis sizes is 8 but there are 4"):
    M.plan_memory(get_config("tiny"), "2x4x1", num_devices=4, **SMALL)
  assert sh.parse_mesh("2x4x1").resolve(8).shape == (2, 4, 1)


# The plan's numbers as of d163683 (before plan_memory was split into one function per term):
# the flagship's 1- and 4-device plans (`--config qwen3_1p7b --dry-run`) and one with every
# optional term on. A change to any term's arithmetic shows here, to the byte.
FLAGSHIP = dict(batch_slots=64, context_len=34816, train_seq_len=34816, logits_chunk=128,
                landmark_dtype="bfloat16", device_bytes=141e9, kv_cache_fraction=0.8,
                mean_context_len=18432, logprob_seq_len=34816, distill=False, prefill_len=2048,
                decode_pages=256, max_prefill_tokens=32768)
PINNED_FLAGSHIP = {
    1: (42035, {"rollout_decode": (84248455424, 20646899716),
                "rollout_prefill": (86281686231, 20646899716),
                "rollout_readmit": (86365464852, 20646899716),
                "recompute": (13140291174, 13764599812), "update": (39976960409, 13764599812),
                "update_apply": (37095596486, 0)}),
    4: (48581, {"rollout_decode": (96635791616, 5162840068),
                "rollout_prefill": (98669022423, 5162840068),
                "rollout_readmit": (98752801044, 5162840068),
                "recompute": (6092666470, 3441893380), "update": (24634917273, 3441893380),
                "update_apply": (9275902652, 0)})}


@pytest.mark.parametrize("n", [1, 4])
def test_flagship_plan_is_pinned(n):
  cfg = get_config("qwen3_1p7b", dtype="bfloat16", param_dtype="float32")
  rows = 2 * n  # the preset's micro-batch: 2 rows per device
  plan = M.plan_memory(cfg, "fsdp=-1", num_devices=n, train_micro_batch=rows,
                       logprob_micro_batch=rows, **FLAGSHIP)
  pages, phases = PINNED_FLAGSHIP[n]
  assert plan.kv_pool_pages == pages
  assert {p.name: (p.program, p.resident) for p in plan.phases} == phases
  assert plan.concurrency == {"max_len": 34816, "mean_len": 18432,
                              "at_max": {1: 19, 4: 22}[n], "at_mean": {1: 36, 4: 42}[n]}


def test_plan_with_every_term_is_pinned():
  plan = M.plan_memory(
      get_config("qwen3_0p6b"), "data=2,fsdp=2,tensor=2", batch_slots=32, context_len=4096,
      train_micro_batch=8, train_seq_len=4096, lora_rank=16, lora_targets=("q", "v", "down"),
      reference_model=True, probe=True, release_kv_cache=False, landmark="quest",
      decode_backend="xla", decode_pages=40, max_prefill_tokens=20000, prefill_len=512,
      param_dtype="bfloat16", device_bytes=80e9)
  assert plan.kv_pool_pages == 8193
  assert {i.name: i.per_device for i in plan.items} == {
      "params": 298123264, "grads": 298123264, "optimizer": 1788739588,
      "reference": 298123264, "lora": 33031488, "activations": 1996215910,
      "fsdp_buffers": 311164928, "rollout_params": 1192099840, "kv_cache": 31947751552}
  assert {p.name: (p.program, p.resident) for p in plan.phases} == {
      "rollout_decode": (33639833728, 2418017604), "rollout_prefill": (34311215969, 2418017604),
      "rollout_readmit": (33426311224, 2418017604), "recompute": (1012157849, 34067645892),
      "reference": (1010814361, 34067645892), "distill": (2622019846, 34051130148),
      "distill_apply": (44509930, 34332737668), "probe": (1096247427, 34059388020),
      "update": (3201750630, 34067645892), "update_apply": (3213768789, 32278906304)}


def test_phase_residents_are_the_state_rows():
  """What each phase holds beside its program, in terms of the plan's rows: rolling out keeps
  the training state; a pool held through training adds to every training phase."""
  kw = dict(SMALL, lora_rank=4, lora_targets=("q", "v"), reference_model=True, probe=True)
  cfg = get_config("tiny")
  plan = M.plan_memory(cfg, "1x1x1", **kw)
  state = plan["params"] + plan["optimizer"] + plan["reference"] + plan["lora"]
  for name in ("rollout_decode", "rollout_prefill", "rollout_readmit"):
    assert plan.phase(name).resident == state
    assert plan.phase(name).program > plan["kv_cache"]
  assert plan.phase("update").resident == state - plan["params"]
  assert plan.phase("distill_apply").resident == state - plan["lora"]
  assert [p.name for p in plan.phases] == [
      "rollout_decode", "rollout_prefill", "rollout_readmit", "recompute", "reference",
      "distill", "distill_apply", "probe", "update", "update_apply"]
  held = M.plan_memory(cfg, "1x1x1", release_kv_cache=False, kv_cache_pages=plan.kv_pool_pages,
                       **kw)
  for a, b in zip(plan.phases, held.phases):
    extra = 0 if a.name.startswith("rollout") else plan["kv_cache"]
    assert (b.program, b.resident) == (a.program, a.resident + extra), a.name
  # No recompute (skipped) and no LoRA phases without distillation.
  bare = M.plan_memory(cfg, "1x1x1", **dict(kw, skip_recompute=True, distill=False))
  assert "recompute" not in [p.name for p in bare.phases]
  assert "distill" not in [p.name for p in bare.phases]
