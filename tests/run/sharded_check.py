"""8-fake-CPU-device checks for sharding.py, run as a script by test_sharding.py.

XLA_FLAGS must be set before jax is imported, and pytest's top-level conftest imports jax in
the test process, so this runs in a fresh interpreter and prints one JSON object (last line of
stdout) that the test asserts on. Usage: `python tests/run/sharded_check.py OUT_DIR`.
"""

import os

# LLVM optimisation level 0 halves the compile time of these small programs; the reference
# and the sharded runs share the flags, so the comparison is unaffected.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0"
                           " --xla_llvm_disable_expensive_passes=true").strip()

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from sparrow_jax.models.config import get_config  # noqa: E402
from sparrow_jax.models.decoder import forward, init_model  # noqa: E402
from sparrow_jax.run import checkpointing, memory  # noqa: E402
from sparrow_jax.run import sharding as sh  # noqa: E402


def _loss(graphdef, state, tokens):
  logits = forward(graphdef, state, tokens[:, :-1])  # [B, T-1, V] float32
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return nll.mean()


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _shard_bytes(tree):
  """Bytes of device 0's shards (what one device holds)."""
  dev0 = jax.devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    total += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev0)
  return total


def run_mesh(mesh_spec, cfg, graphdef, state0, opt0, tokens, tx, ref):
  """One sharded run of two training steps; returns comparisons against `ref`."""
  mesh = sh.make_mesh(sh.parse_mesh(mesh_spec))
  p_specs, fallbacks = sh.param_specs(state0, mesh)
  p_shard = sh.param_shardings(state0, mesh)
  o_shard = sh.opt_state_shardings(opt0, p_specs, mesh, params_abstract=state0)
  state = sh.shard_tree(state0, p_shard)
  opt = sh.shard_tree(opt0, o_shard)
  toks = sh.shard_batch(tokens, mesh)

  def step(state, opt, tokens):
    loss, grads = jax.value_and_grad(_loss, argnums=1)(graphdef, state, tokens)
    updates, opt = tx.update(grads, opt, state)
    return optax.apply_updates(state, updates), opt, loss

  jstep = jax.jit(step, in_shardings=(p_shard, o_shard, sh.batch_sharding(mesh)),
                  out_shardings=(p_shard, o_shard, sh.replicated(mesh)))
  losses = []
  for _ in range(2):
    state, opt, loss = jstep(state, opt, toks)
    losses.append(float(loss))

  q = state["layers"][0]["attn"]["q_DNH"].value
  emb = state["embed_VD"].value
  mu_q = opt[0].mu["layers"][0]["attn"]["q_DNH"].value
  sizes = dict(mesh.shape)
  plan_dev, _, _ = memory.per_device_bytes(state0, sizes)
  return {
      "mesh": dict(mesh.shape),
      "axis_types": [str(t) for t in mesh.axis_types],
      "losses": losses,
      "max_diff_params": _max_diff(state, ref["state"]),
      "max_diff_opt": _max_diff(opt, ref["opt"]),
      "max_diff_loss": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
      "q_spec": list(q.sharding.spec),
      "q_shard_shape": list(q.addressable_shards[0].data.shape),
      "q_num_distinct": len({tuple((s.start, s.stop) for s in sh_.index)
                             for sh_ in q.addressable_shards}),
      "embed_spec": list(emb.sharding.spec),
      "embed_shard_shape": list(emb.addressable_shards[0].data.shape),
      "mu_q_spec": list(mu_q.sharding.spec),
      "count_spec": list(opt[0].count.sharding.spec),
      "tokens_shard_shape": list(toks.addressable_shards[0].data.shape),
      "fallbacks": [str(f) for f in fallbacks],
      "param_bytes_dev0": _shard_bytes(state),
      "param_bytes_planned": plan_dev,
      "opt_bytes_dev0": _shard_bytes(opt),
      "state": state, "opt": opt, "mesh_obj": mesh, "p_shard": p_shard,
  }


def main(out_dir):
  import time
  t0 = time.time()
  tick = lambda m: print(f"[{time.time() - t0:6.1f}s] {m}", file=sys.stderr)  # noqa: E731
  results = {"device_count": jax.device_count()}
  cfg = get_config("tiny")
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: init_model(cfg, seed=0)))
  init_fn = lambda: nnx.split(init_model(cfg, seed=0))[1]  # noqa: E731
  state0 = jax.jit(init_fn)()  # one compile instead of op-by-op init
  # Adam divides by sqrt(nu) + eps: with the default eps=1e-8, elements whose gradient is
  # ~1e-8 turn float32 reduction-order noise (~1e-8 here) into O(lr) differences. eps=1e-6
  # keeps the sharded-vs-single comparison well conditioned (measured: 1.4e-6 vs 2e-5).
  tx = optax.adamw(1e-3, eps=1e-6, weight_decay=0.1)
  opt0 = tx.init(state0)
  tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size, jnp.int32)

  # Single-device reference (devices()[0], no mesh).
  def step(state, opt, tokens):
    loss, grads = jax.value_and_grad(_loss, argnums=1)(graphdef, state, tokens)
    updates, opt = tx.update(grads, opt, state)
    return optax.apply_updates(state, updates), opt, loss

  jstep = jax.jit(step)
  s, o, losses = state0, opt0, []
  for _ in range(2):
    s, o, loss = jstep(s, o, tokens)
    losses.append(float(loss))
  ref = {"state": s, "opt": o, "losses": losses}
  results["ref_losses"] = losses
  tick("reference")
  results["ref_num_devices"] = len(jax.tree.leaves(s)[0].devices())

  for name, spec in (("dp_fsdp", "data=2,fsdp=4"), ("fsdp_tp", "1x4x2")):
    r = run_mesh(spec, cfg, graphdef, state0, opt0, tokens, tx, ref)
    state, mesh, p_shard = r.pop("state"), r.pop("mesh_obj"), r.pop("p_shard")
    r.pop("opt")
    results[name] = r
    tick(name)

  # sharded_init: initialised directly with out_shardings, equal to the plain init.
  st, _ = sh.sharded_init(init_fn, mesh)
  results["sharded_init_max_diff"] = _max_diff(st, state0)
  results["sharded_init_q_spec"] = list(st["layers"][0]["attn"]["q_DNH"].value.sharding.spec)

  tick("sharded_init")
  # Checkpoint the sharded state and restore it onto the mesh and onto one device.
  ck = checkpointing.Checkpointer(os.path.join(out_dir, "ckpt"), keep_last=2)
  ck.save(5, {"params": state, "rng": jax.random.key(7)}, {"mesh": "1x4x2"})
  ck.wait()
  abstract = {"params": sh.abstract_with_shardings(state, p_shard),
              "rng": jax.eval_shape(lambda: jax.random.key(0))}
  restored, meta = checkpointing.Checkpointer(os.path.join(out_dir, "ckpt")).restore(
      abstract_state=abstract)
  rq = restored["params"]["layers"][0]["attn"]["q_DNH"].value
  results["restore_max_diff"] = _max_diff(restored["params"], state)
  results["restore_q_spec"] = list(rq.sharding.spec)
  results["restore_q_shard_shape"] = list(rq.addressable_shards[0].data.shape)
  results["restore_meta"] = meta
  one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
  abstract1 = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                     sharding=one), state),
               "rng": jax.eval_shape(lambda: jax.random.key(0))}
  restored1, _ = checkpointing.Checkpointer(os.path.join(out_dir, "ckpt")).restore(
      abstract_state=abstract1)
  results["restore_single_max_diff"] = _max_diff(restored1["params"], state)
  results["restore_single_devices"] = sorted(
      {d.id for x in jax.tree.leaves(restored1["params"]) for d in x.devices()})

  def _spec_str(v):
    return [None if e is None else e for e in v]

  for k in ("dp_fsdp", "fsdp_tp"):
    for f in ("q_spec", "embed_spec", "mu_q_spec", "count_spec"):
      results[k][f] = _spec_str(results[k][f])
  print(json.dumps(results, default=str))


if __name__ == "__main__":
  main(sys.argv[1])
