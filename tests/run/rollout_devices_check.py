"""`rollout_devices=4` on 8 fake CPU devices against the time-shared run (engine and learner on
all 8): the first step's rollouts and loss. Run as a script by test_async.py (XLA_FLAGS must be
set before jax is imported); prints one JSON object on the last line."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from tests.rl import reward_helpers  # noqa: E402,F401  (registers test_parity)
from sparrow_jax.run import producer as producer_lib  # noqa: E402
from sparrow_jax.run.config import get_train_config  # noqa: E402
from sparrow_jax.run.trainer import Trainer  # noqa: E402

SMALL = ["warmstart_steps=0", "prompts_per_step=2", "group_size=4", "num_slots=4",
         "max_new_tokens=12", "ignore_eos=true", "decode_chunk=4", "tensorboard=false",
         "distill=false", "reward=test_parity", "reward_workers=1", "sample_every=0", "max_staleness=1",
         "partial_rollouts=true", "skip_redundant_recompute=false", "adam_eps=1e-6"]


def _ids(tree) -> list[int]:
  return sorted({d.id for x in jax.tree.leaves(tree) for d in x.devices()})


def main(out_dir: str) -> None:
  # per-request lengths 3..12 (ignore_eos): some sequences outlive their step
  producer_lib.Producer.response_budget = lambda self, seed: 3 + int(seed) % 10
  res = {}
  for k in (0, 4):
    cfg = get_train_config("tiny", SMALL + [f"out_dir={out_dir}/k{k}", f"rollout_devices={k}"])
    with Trainer(cfg, quiet=True) as tr:
      first = tr.train_step()
      comps = tr.last_rollout[1]
      later = [tr.train_step() for _ in range(1 if k else 0)]
      res[k] = dict(
          loss=first["loss/total"], grad_norm=first["grad_norm"],
          tokens=[c.token_ids.tolist() for c in comps],
          logprobs=[c.logprobs.tolist() for c in comps],
          versions=[c.versions.tolist() for c in comps],
          ids=[list(c.request_id) for c in comps],
          learner_devices=_ids(tr.state.params), engine_devices=_ids(tr.engine.state),
          engine_shards=tr.engine.num_shards, steps=int(tr.state.step),
          weight_sync_s=[m.get("async/weight_sync_s") for m in [first, *later]],
          staleness_max=max(m["async/staleness_max"] for m in [first, *later]),
          partial_frac=[m["async/partial_frac"] for m in [first, *later]],
          finite=all(np.isfinite(m["loss/total"]) for m in [first, *later]))
  # async_overlap: the engine decodes on devices 4-7 while the learner trains on 0-3.
  cfg = get_train_config("tiny", SMALL + [f"out_dir={out_dir}/overlap", "rollout_devices=4",
                                          "async_overlap=true"])
  with Trainer(cfg, quiet=True) as tr:
    ms = [tr.train_step() for _ in range(4)]
    overlap = dict(
        steps=int(tr.state.step), chunks=[m["async/overlap_chunks"] for m in ms],
        overlap_s=[m["async/overlap_s"] for m in ms],
        staleness_max=max(m["async/staleness_max"] for m in ms),
        over_stale=sum(m["async/over_stale_tokens"] for m in ms),
        trained_tokens=[m["rollout/tokens"] for m in ms],
        finite=all(np.isfinite(m["loss/total"]) for m in ms))
  a, b = res[0], res[4]
  lp = max(float(np.max(np.abs(np.subtract(x, y)))) for x, y in zip(a["logprobs"],
                                                                    b["logprobs"]))
  print(json.dumps({"overlap": overlap,
                    "shared": {k: v for k, v in a.items() if k not in ("tokens", "logprobs")},
                    "split": {k: v for k, v in b.items() if k not in ("tokens", "logprobs")},
                    "same_tokens": a["tokens"] == b["tokens"], "same_ids": a["ids"] == b["ids"],
                    "same_versions": a["versions"] == b["versions"],
                    "logprob_diff": lp, "loss_diff": abs(a["loss"] - b["loss"]),
                    "grad_norm_rel_diff": (abs(a["grad_norm"] - b["grad_norm"]) /
                                           max(a["grad_norm"], 1e-30))}))


if __name__ == "__main__":
  main(sys.argv[1])
