"""The trainer's GRPO update on a 2x4 (data x fsdp) mesh of 8 fake CPU devices against the
same update on one device. Run as a script by test_sharding.py (XLA_FLAGS must be set before
jax is imported); prints one JSON object on the last line."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from sparrow_jax.rl import grpo  # noqa: E402
from sparrow_jax.run import stages  # noqa: E402
from sparrow_jax.run.config import get_train_config  # noqa: E402
from sparrow_jax.run.trainer import Trainer  # noqa: E402


def _old_logp(tr, batch):
  return stages.dense_logprobs(tr.learner, tr.params, None, batch,
                               tr.learner.logprob_plan(batch["lengths"]))["old_logp"]


def _apply(tr, full):
  """The GRPO update of `full` on `tr`'s state; its per-update metrics."""
  tr.state, metrics, _, _ = stages.apply_updates(tr.learner, tr.state, full)
  return metrics


def main(out_dir):
  base = ["warmstart_steps=0", "prompts_per_step=4", "group_size=4", "num_slots=16",
          "tensorboard=false", "distill=false", "max_new_tokens=4",
          # Adam divides by sqrt(v) + eps: with eps=1e-8, gradients of ~1e-8 turn the ~1e-9
          # rounding differences of a different reduction order into 1e-5 parameter gaps.
          "adam_eps=1e-6", "skip_redundant_recompute=false", "max_prompt_len=12"]
  single = Trainer(get_train_config("tiny", base + ["mesh=data=1,fsdp=1,tensor=1",
                                                    f"out_dir={out_dir}/a"]), quiet=True)
  sharded = Trainer(get_train_config("tiny", base + ["mesh=data=2,fsdp=4,tensor=1",
                                                     f"out_dir={out_dir}/b"]), quiet=True)
  # Micro-batched and sharded: one row per device per micro-batch (16-token budget).
  micro = Trainer(get_train_config("tiny", base + ["mesh=data=2,fsdp=4,tensor=1",
                                                   "max_tokens_per_micro_batch=16",
                                                   f"out_dir={out_dir}/c"]), quiet=True)
  examples = single.dataset.next_batch()
  comps = single.producer.rollout(examples, 1)
  batch = single.make_batch(comps).arrays()
  old = _old_logp(single, batch)
  rewards = np.random.default_rng(0).integers(0, 2, len(comps)).astype(np.float32)
  adv = np.asarray(grpo.group_advantages(rewards, 4))
  full = dict(tokens=batch["tokens"], lengths=batch["lengths"], old_logp=np.asarray(old),
              advantages=adv, mask=batch["mask"])
  old_micro = _old_logp(micro, batch)
  m = batch["mask"] > 0
  recompute_diff = float(np.max(np.abs(np.asarray(old)[m] - old_micro[m])))
  n_micro = len(micro.learner.update_plan(batch["lengths"]))
  m1, m2, m3 = (_apply(t, full) for t in (single, sharded, micro))
  p1 = jax.tree.leaves(jax.device_get(single.params))
  p2 = jax.tree.leaves(jax.device_get(sharded.params))
  p3 = jax.tree.leaves(jax.device_get(micro.params))
  q = sharded.params["layers"][0]["attn"]["q_DNH"].value
  # The programs trace with activation sharding hints: the lowered forward carries a batch
  # sharding constraint at every layer boundary (none without the hints).
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from sparrow_jax.models.sharding_hints import batch_sharding
  from sparrow_jax.run.sharding import BATCH_AXES
  toks = jax.device_put(np.asarray(batch["tokens"]), NamedSharding(sharded.mesh, P(BATCH_AXES)))
  fwd = lambda st, t: nnx.merge(sharded.graphdef, st).hidden_states(t)
  count = lambda txt: txt.count("@Sharding") + txt.count("sdy.sharding_constraint")
  plain = count(jax.jit(fwd).lower(sharded.params, toks).as_text())
  fwd2 = lambda st, t: fwd(st, t)  # (a new function: jit caches traces per function)
  with batch_sharding(sharded.mesh, BATCH_AXES):
    hinted = count(jax.jit(fwd2).lower(sharded.params, toks).as_text())
  print(json.dumps({
      "hint_constraints": hinted - plain,
      "num_layers": sharded.model_cfg.num_layers,
      "max_param_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(p1, p2)),
      "loss_diff": abs(float(m1[0]["loss"]) - float(m2[0]["loss"])),
      "grad_norm_rel_diff": abs(float(m1[0]["grad_norm"]) - float(m2[0]["grad_norm"]))
                            / float(m1[0]["grad_norm"]),
      "q_spec": [str(x) for x in q.sharding.spec],
      "q_global": list(q.shape),
      "q_shard": list(q.addressable_shards[0].data.shape),
      "num_devices": len(sharded.mesh.devices.flatten()),
      "micro_batches": n_micro,
      "micro_recompute_diff": recompute_diff,
      "micro_max_param_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(p1, p3)),
      "micro_loss_diff": abs(float(m1[0]["loss"]) - float(m3[0]["loss"])),
  }))


if __name__ == "__main__":
  main(sys.argv[1])
