"""Tests for sparrow_jax.run.sharding: mesh parsing, partition rules, optimizer-state specs,
multi-host detection, and (in a subprocess with 8 fake CPU devices) a sharded training step.

Why a subprocess: `--xla_force_host_platform_device_count=8` only works if XLA_FLAGS is set
before jax is imported, and `tests/conftest.py` imports jax in every pytest process. So
`sharded_check.py` runs in a fresh interpreter with the flag set and prints its measurements
as JSON; the assertions are here. This process keeps its single CPU device.
"""

import json
import os
import subprocess
import sys

import jax
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import Decoder, init_model
from sparrow_jax.run import sharding as sh

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _abstract_state(cfg):
  return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))[1]


def _leaves_with_specs(tree, specs):
  paths = [sh.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  leaves = jax.tree.leaves(tree)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  assert len(leaves) == len(spec_leaves)
  return list(zip(paths, leaves, spec_leaves))


# ----------------------------------------------------------------------------- mesh config


@pytest.mark.parametrize("text,shape", [
    ("data=2,fsdp=4", (2, 4, 1)),
    ("2x4x1", (2, 4, 1)),
    ("fsdp=4, tensor=2", (1, 4, 2)),
    ("tensor=2,fsdp=-1", (1, -1, 2)),
    ("1X-1X2", (1, -1, 2)),
    ("", (1, -1, 1)),
    ("auto", (1, -1, 1)),
])
def test_parse_mesh_forms(text, shape):
  assert sh.parse_mesh(text).shape == shape


@pytest.mark.parametrize("text,needle", [
    ("data=2,pipeline=4", "unknown axis 'pipeline'"),
    ("data=2,data=4", "given twice"),
    ("data=two", "expected an integer"),
    ("2x4", "expected 3 sizes"),
    ("data=0", "expected a positive int or -1"),
    ("data=-1,fsdp=-1", "at most one axis may be -1"),
    ("data2", "expected 3 sizes"),
    ("data=2,fsdp", "is not name=size"),
])
def test_parse_mesh_errors(text, needle):
  with pytest.raises(ValueError, match=needle):
    sh.parse_mesh(text)


def test_mesh_resolve():
  assert sh.parse_mesh("data=2,fsdp=-1").resolve(8).shape == (2, 4, 1)
  assert sh.MeshConfig().resolve(32).shape == (1, 32, 1)
  with pytest.raises(ValueError, match="product of the axis sizes is 8 but there are 4"):
    sh.parse_mesh("2x4x1").resolve(4)
  with pytest.raises(ValueError, match="does not divide the device count 8"):
    sh.parse_mesh("data=3,fsdp=-1").resolve(8)
  with pytest.raises(ValueError, match="call .resolve"):
    sh.MeshConfig().axis_sizes()


def test_make_mesh_single_device_auto_axes():
  mesh = sh.make_mesh("1x1x1")
  assert mesh.axis_names == sh.AXES
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  # A default (fill) mesh takes every device of this process.
  assert dict(sh.make_mesh(None).shape)["fsdp"] == jax.device_count()
  with pytest.raises(ValueError, match="product of the axis sizes is 2"):
    sh.make_mesh("2x1x1")


# ----------------------------------------------------------------------------- rules


@pytest.mark.parametrize("name,overrides", [
    ("tiny", {}),
    ("smollm2_135m", {}),
    ("qwen3_1p7b", {}),
    ("qwen3_8b", {"num_layers": 2}),  # untied lm_head
    ("tiny", {"attention_bias": True, "qk_norm": False}),  # Qwen2-style biases
])
def test_rules_cover_every_leaf(name, overrides):
  cfg = get_config(name, **overrides)
  state = _abstract_state(cfg)
  sizes = {"data": 2, "fsdp": 4, "tensor": 2}
  specs, fallbacks = sh.param_specs(state, sizes)
  rows = _leaves_with_specs(state, specs)
  assert len(rows) == len(jax.tree.leaves(state))
  n = 0
  for path, leaf, spec in rows:
    assert len(spec) == leaf.ndim, path
    for d, entry in enumerate(spec):  # every sharded dim divides its axes
      if entry is not None:
        assert leaf.shape[d] % sizes[entry] == 0, (path, d)
    n += leaf.size
  assert n == cfg.num_params()
  # The same specs from the pure-dict form.
  pure_specs, _ = sh.param_specs(state.to_pure_dict(), sizes)
  assert (jax.tree.leaves(pure_specs, is_leaf=lambda x: isinstance(x, P))
          == jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
  by_path = {p: s for p, _, s in rows}
  assert by_path["layers/1/mlp/down_FD"] == P("tensor", "fsdp")
  assert by_path["embed_VD"] == P("tensor", "fsdp")
  assert by_path["final_norm/scale"] == P(None)
  if not cfg.tie_word_embeddings:
    assert by_path["lm_head_DV"] == P("fsdp", "tensor")
  if cfg.attention_bias:
    assert by_path["layers/0/attn/k_bias_KH"] == P("tensor", None)
  if name == "smollm2_135m":  # 9 heads / 3 kv heads do not split over tensor=2
    assert by_path["layers/0/attn/q_DNH"] == P("fsdp", None, None)
    assert {(f.path.split("/")[-1], f.dim) for f in fallbacks} == {
        ("q_DNH", 1), ("k_DKH", 1), ("v_DKH", 1), ("o_NHD", 0)}
    assert by_path["layers/0/attn/o_NHD"] == P(None, None, "fsdp")
    assert any("[30 leaves]" in s for s in sh.summarize_fallbacks(fallbacks))
  else:
    assert by_path["layers/0/attn/q_DNH"] == P("fsdp", "tensor", None)
    assert fallbacks == []


def test_nondivisible_dimension_falls_back_only_there():
  spec, fbs = sh.spec_for("layers/3/mlp/gate_DF", (64, 100), {"fsdp": 4, "tensor": 8})
  assert spec == P("fsdp", None)
  assert [(f.dim, f.size, f.axes_size) for f in fbs] == [(1, 100, 8)]
  assert "not divisible by tensor=8" in str(fbs[0])


def test_unknown_path_raises_unless_marked():
  tree = {"layers": {"0": {"attn": {"q_DNH": jax.ShapeDtypeStruct((8, 2, 4), "float32")}}},
          "value_head_D1": jax.ShapeDtypeStruct((8, 1), "float32")}
  sizes = {"data": 1, "fsdp": 2, "tensor": 1}
  with pytest.raises(ValueError, match="no partition rule matches parameter 'value_head_D1'"):
    sh.param_specs(tree, sizes)
  specs, _ = sh.param_specs(tree, sizes, extra_rules=[(r"value_head_D1$", sh.REPLICATED)])
  assert specs["value_head_D1"] == P(None, None)
  # A rule may split one dimension over several axes; lists are accepted.
  specs, _ = sh.param_specs(tree, sizes,
                            extra_rules=[(r"value_head_D1$", [["data", "fsdp"], None])])
  assert specs["value_head_D1"] == P(("data", "fsdp"), None)
  with pytest.raises(ValueError, match="mesh axis used twice"):
    sh.param_specs(tree, sizes, extra_rules=[(r"value_head_D1$", ("fsdp", "fsdp"))])


def test_rule_rank_mismatch_and_unknown_axis_raise():
  with pytest.raises(ValueError, match="expected one entry per dimension"):
    sh.spec_for("layers/0/attn/q_DNH", (8, 2), {"fsdp": 1, "tensor": 1})
  with pytest.raises(ValueError, match="names mesh axis 'tensor'"):
    sh.spec_for("layers/0/attn/q_DNH", (8, 2, 4), {"fsdp": 1})


def test_lora_rules():
  from sparrow_jax.run.memory import abstract_lora
  cfg = get_config("qwen3_0p6b", num_layers=1)
  lora = abstract_lora(cfg, 8, ("q", "k", "o", "gate", "down"))
  specs, fbs = sh.param_specs(lora, {"data": 1, "fsdp": 4, "tensor": 2})
  got = {sh.path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, P))[0]}
  assert got["layers/0/q/a"] == P("fsdp", None)
  assert got["layers/0/q/b"] == P(None, "tensor", None)
  assert got["layers/0/o/a"] == P("tensor", None, None)
  assert got["layers/0/o/b"] == P(None, "fsdp")
  assert got["layers/0/down/a"] == P("tensor", None)
  assert got["layers/0/gate/b"] == P(None, "tensor")
  assert got["layers/0/k/scale"] == P()
  assert fbs == []


# ----------------------------------------------------------------------------- optimizer state


def test_opt_state_specs_follow_params():
  cfg = get_config("tiny")
  state = _abstract_state(cfg)
  sizes = {"data": 1, "fsdp": 4, "tensor": 2}
  specs, _ = sh.param_specs(state, sizes)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 5, 50)))
  opt = jax.eval_shape(tx.init, state)
  ospecs = sh.opt_state_specs(opt, specs, state)
  adam = ospecs[1][0]
  assert adam.count == P()
  chk = [(a, b) for a, b in zip(jax.tree.leaves(adam.mu, is_leaf=lambda x: isinstance(x, P)),
                                jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))]
  assert chk and all(a == b for a, b in chk)
  assert adam.nu["layers"][1]["attn"]["o_NHD"].value == P("tensor", None, "fsdp")
  # Pure-dict params with an optax state over the pure dict.
  pure = state.to_pure_dict()
  pspecs, _ = sh.param_specs(pure, sizes)
  ospecs2 = sh.opt_state_specs(jax.eval_shape(tx.init, pure), pspecs)
  assert ospecs2[1][0].mu["layers"][0]["mlp"]["up_DF"] == P("fsdp", "tensor")


def test_opt_state_specs_nnx_optimizer_and_unmatched():
  def build():
    model = init_model(get_config("tiny"))
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

  model, opt = nnx.eval_shape(build)
  params = nnx.state(model, nnx.Param)
  specs, _ = sh.param_specs(params, {"data": 1, "fsdp": 2, "tensor": 1})
  ospecs = sh.opt_state_specs(nnx.state(opt, nnx.OptState), specs, params)
  flat = {sh.path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
      ospecs, is_leaf=lambda x: isinstance(x, P))[0]}
  assert flat["opt_state/0/mu/layers/0/attn/q_DNH"] == P("fsdp", "tensor", None)
  assert flat["opt_state/0/count"] == P() and flat["step"] == P()
  bad = {"mu": {"layers": {0: {"attn": {"q_DNH": jax.ShapeDtypeStruct((3, 3), "float32")}}}}}
  with pytest.raises(ValueError, match="matches no parameter of the same shape"):
    sh.opt_state_specs(bad, specs, params)


def test_batch_sharding_and_divisibility():
  mesh = sh.make_mesh("1x1x1")
  assert sh.batch_sharding(mesh).spec == P(("data", "fsdp"))
  assert sh.batch_divisor({"data": 2, "fsdp": 4, "tensor": 2}) == 8
  out = sh.shard_batch({"tokens": jax.numpy.zeros((4, 3), jax.numpy.int32)}, mesh)
  assert out["tokens"].sharding.spec == P(("data", "fsdp"))
  with pytest.raises(ValueError, match="expected a leading batch dim"):
    sh.shard_batch({"n": jax.numpy.zeros(())}, mesh)


# ----------------------------------------------------------------------------- 8 devices


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharded")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the script sets its own
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "run", "sharded_check.py"),
                         str(out)], env=env, capture_output=True, text=True, timeout=900,
                        cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["dp_fsdp", "fsdp_tp"])
def test_sharded_step_equals_single_device(sharded, name):
  assert sharded["device_count"] == 8
  assert sharded["ref_num_devices"] == 1
  r = sharded[name]
  assert r["axis_types"] == ["AxisType.Auto"] * 3
  assert r["max_diff_loss"] < 1e-5
  assert r["max_diff_params"] < 1e-5
  assert r["max_diff_opt"] < 1e-5
  # The step really moved the parameters (the comparison can fail).
  assert abs(r["losses"][1] - r["losses"][0]) > 1e-3


def test_parameters_really_are_sharded(sharded):
  a, b = sharded["dp_fsdp"], sharded["fsdp_tp"]
  assert a["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
  # tiny: D=64, N=4, H=32, V=512. data=2 x fsdp=4: q [64,4,32] -> [16,4,32], 4 distinct shards.
  assert a["q_spec"] == ["fsdp", "tensor", None] and a["q_shard_shape"] == [16, 4, 32]
  assert a["q_num_distinct"] == 4
  assert a["embed_spec"] == ["tensor", "fsdp"] and a["embed_shard_shape"] == [512, 16]
  assert a["mu_q_spec"] == ["fsdp", "tensor", None] and a["count_spec"] == []
  assert a["tokens_shard_shape"] == [1, 17]  # batch 8 over data x fsdp = 8
  # fsdp=4 x tensor=2: heads split too, 8 distinct q shards.
  assert b["q_shard_shape"] == [16, 2, 32] and b["q_num_distinct"] == 8
  assert b["embed_shard_shape"] == [256, 16] and b["tokens_shard_shape"] == [2, 17]
  for r in (a, b):  # the planner's arithmetic equals what device 0 really holds
    assert r["param_bytes_planned"] == r["param_bytes_dev0"]
    assert r["opt_bytes_dev0"] == 2 * r["param_bytes_dev0"] + 4  # mu, nu and the count


def test_sharded_init_and_checkpoint_resharding(sharded):
  assert sharded["sharded_init_max_diff"] == 0.0
  assert sharded["sharded_init_q_spec"] == ["fsdp", "tensor", None]
  assert sharded["restore_max_diff"] == 0.0
  assert sharded["restore_q_spec"] == ["fsdp", "tensor", None]
  assert sharded["restore_q_shard_shape"] == [16, 2, 32]
  assert sharded["restore_meta"] == {"mesh": "1x4x2"}
  assert sharded["restore_single_max_diff"] == 0.0
  assert sharded["restore_single_devices"] == [3]


def test_trainer_grpo_update_sharded_2x4_equals_single_device(tmp_path):
  """One piece and micro-batched, on a data=2 x fsdp=4 mesh of 8 CPU devices."""
  script = os.path.join(os.path.dirname(__file__), "sharded_trainer_check.py")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True,
                        env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  assert res["num_devices"] == 8
  assert res["max_param_diff"] <= 1e-5, res
  assert res["loss_diff"] <= 1e-5, res
  assert res["grad_norm_rel_diff"] <= 1e-5, res
  assert res["q_spec"][0] == "fsdp"  # q_DNH [D, N, H]: D split over fsdp=4
  assert res["hint_constraints"] >= res["num_layers"], res  # residual stream kept batch-sharded
  assert res["q_shard"][0] * 4 == res["q_global"][0]
  # Micro-batched (a 16-token budget: one row per device) on the same 2x4 mesh: the recompute
  # and the update equal the single-device one-piece ones.
  assert res["micro_batches"] == 2, res
  assert res["micro_recompute_diff"] <= 1e-5, res
  assert res["micro_max_param_diff"] <= 1e-5, res
  assert res["micro_loss_diff"] <= 1e-5, res
