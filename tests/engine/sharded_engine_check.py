"""Rollouts sharded over 8 fake CPU devices against one device. Run as a script by
test_engine_sharded.py (XLA_FLAGS must be set before jax is imported); prints one JSON object
on the last line.

1. Engine: the same requests (distinct prompts, more requests than one device's slots, a pool
   that forces preemption on the 1-device engine) on a 1-device engine and on an engine whose
   mesh spans 8 devices: tokens identical, log-probs equal to 1e-5, for dense and block-sparse
   attention (greedy dense, temperature-1 sparse: the rollouts training samples); the pool is
   really split (one block per device).
2. Agent loop: multi-turn trajectories whose tool responses are appended into the sequences'
   own pages (`Decoder.extend`) on a 1-device engine and on one sharded over 8 devices
   (sequences paused and resumed on every shard): the same trajectories, dense and sparse.
3. Trainer: 2 steps of the tiny run with mesh=data=2,fsdp=4 (rollouts on all 8 devices,
   parameters resharded from the FSDP layout each step) against mesh=data=1,fsdp=1.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request  # noqa: E402
from sparrow_jax.engine.sampling import SamplingParams  # noqa: E402
from sparrow_jax.models.attention import BlockSparse  # noqa: E402
from sparrow_jax.models.config import get_config  # noqa: E402
from sparrow_jax.models.decoder import init_model  # noqa: E402


def engine_part():
  cfg = get_config("tiny", eos_token_ids=(7,), num_layers=3)
  model = init_model(cfg, seed=3)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 500, int(n))) for n in rng.integers(5, 30, 20)]
  mesh8 = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "fsdp"))
  out = {}
  for name, att, temp in (("dense", None, 0.0),
                          ("sparse", BlockSparse(max_budget=1, page_size=4, dense_layers=(0,)),
                           1.0)):
    reqs = [Request(p, SamplingParams(temperature=temp, max_new_tokens=24, seed=i), i)
            for i, p in enumerate(prompts)]
    ecfg = dict(max_seq_len=64, page_size=4, decode_chunk=4)
    one = GenerationEngine(model, EngineConfig(num_slots=4, num_pages=40, **ecfg),
                           attention=att)
    eight = GenerationEngine(model, EngineConfig(num_slots=2, num_pages=24, **ecfg),
                             attention=att, mesh=mesh8)
    a, b = one.generate(reqs), eight.generate(reqs)
    same = all(list(x.token_ids) == list(y.token_ids) for x, y in zip(a, b))
    lp = max(float(np.max(np.abs(x.logprobs - y.logprobs))) for x, y in zip(a, b))
    shards = {d.id for d in eight._kv.k[0].sharding.device_set}
    block = eight._kv.k[0].addressable_shards[0].data.shape
    out[f"{name}_t{temp:g}"] = dict(
        same_tokens=same, max_logprob_diff=lp, devices=len(shards),
        shard_pages=int(block[1]), global_pages=int(eight._kv.k[0].shape[1]),
        preemptions_1dev=one.last_stats["preemptions"],
        admissions_per_device=list(eight.last_scheduler.stats.shard_admissions))
  return out


def agent_part():
  from tests.agents.test_engine_parity import SPARSE, _loop, _requests, _stop_ids, sharp_model
  model = sharp_model()
  mesh8 = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "fsdp"))
  out = {}
  for name, att in (("dense", None), ("sparse", SPARSE)):
    reqs = _requests()
    ecfg = dict(max_seq_len=64, page_size=4, decode_chunk=4)
    one = GenerationEngine(model, EngineConfig(num_slots=6, **ecfg), attention=att)
    eight = GenerationEngine(model, EngineConfig(num_slots=1, num_pages=17, **ecfg),
                             attention=att, mesh=mesh8)
    stop = _stop_ids(one, reqs)
    a = _loop(stop).run(reqs, engine=one)
    b = _loop(stop).run(reqs, engine=eight)
    out[name] = dict(
        same_tokens=all(list(x.token_ids) == list(y.token_ids) for x, y in zip(a, b)),
        same_mask=all(list(x.loss_mask) == list(y.loss_mask) for x, y in zip(a, b)),
        max_logprob_diff=max(float(np.max(np.abs(x.logprobs - y.logprobs)))
                             for x, y in zip(a, b)),
        env_tokens=int(sum(int(np.sum(np.asarray(x.loss_mask) == 0)) for x in b)),
        append_tokens_1dev=one.last_stats["append_tokens"],
        append_tokens_8dev=eight.last_stats["append_tokens"],
        prefill_tokens_8dev=eight.last_stats["prefill_tokens"],
        prompt_tokens=sum(len(r.prompt_ids) for r in reqs),
        preemptions_8dev=eight.last_stats["preemptions"],
        admissions_per_device=list(eight.last_scheduler.stats.shard_admissions))
  return out


def trainer_part(out_dir):
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.trainer import Trainer

  base = ["warmstart_steps=0", "prompts_per_step=4", "group_size=4", "num_slots=4",
          "tensorboard=false", "distill=false", "max_new_tokens=6", "num_steps=2",
          "adam_eps=1e-6", "save_every=0", "entropy_coeff=0.01"]
  runs = {}
  for name, mesh in (("single", "data=1,fsdp=1,tensor=1"), ("sharded", "data=2,fsdp=4,tensor=1")):
    tr = Trainer(get_train_config("tiny", base + [f"mesh={mesh}", f"out_dir={out_dir}/{name}"]),
                 quiet=True)
    runs[name] = [tr.train_step() for _ in range(2)]
    runs[name + "_engine_devices"] = tr.engine.num_shards
  keys = ("reward/mean", "response/len_mean", "rollout/tokens", "loss/total", "grad_norm")
  return {"engine_devices": runs["sharded_engine_devices"],
          "metrics": {k: [[float(m[k]) for m in runs["single"]],
                          [float(m[k]) for m in runs["sharded"]]] for k in keys}}


if __name__ == "__main__":
  print(json.dumps({"engine": engine_part(), "agent": agent_part(),
                    "trainer": trainer_part(sys.argv[1])}))
