"""Synchronous against asynchronous training steps on a long-tailed response-length law.

    python benchmarks/async_throughput.py                 # 3 warm-up + 8 timed steps per mode
    python benchmarks/async_throughput.py --steps 12 --median 32
    python benchmarks/async_throughput.py --smoke         # a few short steps (tests)

The same config (the `tiny` preset: random-init tiny Qwen3, no warm start, dense attention)
runs in one process in two trainers, a step of each in turn: synchronously
(`max_staleness=0`) and asynchronously
(`max_staleness=1 partial_rollouts=true`; `--staleness N`: another N). Every request's
response length is drawn from a lognormal law (sigma = 0.75, median `--median` tokens, so
p99 / p50 = exp(2.326 x 0.75) ~ 5.7) through its own `max_new_tokens` with `ignore_eos=true`,
keyed by the request's sampling seed (the async run's prompt draws use the seeds the
synchronous steps use, so both modes see the same prompts and lengths in the same order).
The slots hold one batch (`num_slots` = prompts_per_step x group_size), so the synchronous
step's decode chunks run fewer and fewer sequences while its longest rollout finishes, which
is the waste asynchronous steps remove. With the per-token bound (a step trains on no token
older than N versions) a step still waits for every sequence started N versions ago: at N = 1
that caps the asynchronous occupancy well below 1 on this law (BENCHMARKS.md, 2026-12-05
async); `--staleness 2` shows the trade.

Measured per mode after `--warmup` steps (compilation): trained tokens (the loss mask's
response tokens of every step's batch) per second of wall time, with the wall time of each
step less the part of it that was compilation (`time/compile_s`: new length buckets can still
compile after the warm-up, on either side); engine occupancy = busy / (busy + idle)
slot-steps of the decode chunks run during the timed steps; decode steps and trained tokens
per decode step (`decode_step_ratio`: async / sync, the rollout work saved, whatever the
machine's load). The realised response lengths' p50 / p90 / p99 are printed (trained rows
of both modes). The learner pads lengths to powers of two (`--length-buckets 1`): with the preset's 8 buckets
per octave nearly every timed step's batch fell in a new bucket and compiled a new update
program (47-68 s of compilation over 8 timed steps per mode on 2026-12-05); `time/compile_s`
subtracts the compilation but not the tracing, which then leaked into the timed wall time.
Per mode the script prints where the timed steps' wall time goes (phases less their
compilation, and what compiled where), the engine's prefill calls, decode chunks and
seconds waiting for the device.
Both trainers share one XLA compilation cache (in the run's temporary
directory: the second finds the first's larger programs there) and score in a verifier
thread. `--smoke` takes ~30 s of CPU time (user), nearly all of it XLA compiling the two
trainers' programs (the asynchronous update is a program of its own: its loss caps the
behaviour weight); its wall time is that on an idle 2-core machine, about twice it at a load
average of 8. The last stdout line is one JSON
object: {"sync_tokens_per_s", "async_tokens_per_s", "ratio", "sync_occupancy",
"async_occupancy", "p99_over_p50", ...}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SIGMA = 0.75


def lognormal_length(seed: int, median: float, cap: int) -> int:
  """A response length from lognormal(log median, SIGMA), keyed by a request's seed."""
  z = np.random.default_rng(int(seed) % (1 << 63)).standard_normal()
  return int(min(max(round(median * np.exp(SIGMA * z)), 1), cap))


def config(args, *, staleness: int, out_dir: str, cache_dir: str = ""):
  from sparrow_jax.run.config import get_train_config
  keys = dict(compile_cache_dir=cache_dir, warmstart_steps=0, distill=False, schedule="dense", page_size=8,
              prompts_per_step=args.prompts, group_size=args.group,
              num_slots=args.prompts * args.group, max_prompt_len=32,
              max_new_tokens=args.max_new, decode_chunk=args.chunk, ignore_eos=True,
              reward_workers=1, tensorboard=False, logger="none", sample_every=0,
              num_steps=args.warmup + args.steps, out_dir=out_dir, seed=args.seed,
              max_staleness=staleness, partial_rollouts=bool(staleness),
              length_buckets_per_octave=args.length_buckets)
  return get_train_config("tiny", [f"{k}={'null' if v is None else v}"
                                   for k, v in keys.items()])


def run_modes(args, modes: dict[str, int]) -> dict[str, dict]:
  """Train every mode (name -> max_staleness) `--warmup` + `--steps` steps, one step of each
  in turn (A B A B ...: load on a shared machine hits both alike); per mode the timed steps'
  trained tokens, wall time less compilation, decode steps and occupancy."""
  from sparrow_jax.run import producer as producer_lib
  median, cap = args.median, args.max_new
  default = producer_lib.Producer.response_budget
  producer_lib.Producer.response_budget = lambda self, seed: lognormal_length(seed, median, cap)
  try:
    return _run(args, modes)
  finally:
    producer_lib.Producer.response_budget = default


def _run(args, modes: dict[str, int]) -> dict[str, dict]:
  from sparrow_jax.run.trainer import Trainer
  res = {k: dict(tokens=0.0, wall_s=0.0, rollout_s=0.0, busy=0, idle=0, decode_steps=0,
                lengths=[], phases={}, engine={}, compile_s=0.0, compile_by_phase={})
         for k in modes}
  with tempfile.TemporaryDirectory() as out:
    # One compilation cache for both trainers: the second finds the first's programs there
    # (the same shapes; nothing timed compiles either way).
    trs = {k: Trainer(config(args, staleness=n, out_dir=f"{out}/{k}",
                             cache_dir=f"{out}/xla_cache"), quiet=True)
           for k, n in modes.items()}
    from sparrow_jax.rl.verifier_pool import RewardScorer
    for tr in trs.values():  # verifiers in a thread: a worker process would import the
      # package again (~5 s of start-up per trainer); exact_match takes microseconds
      tr.producer._scorer = RewardScorer(tr.cfg.reward, timeout_s=tr.cfg.reward_timeout_s,
                                         num_workers=1, backend="thread")
    try:
      for i in range(args.warmup + args.steps):
        for k, tr in trs.items():
          before = _engine_counts(tr)
          compiled: dict[str, float] = {}
          t0 = time.perf_counter()
          rec = tr.run_step(wrap=functools.partial(_compile_timed, compiled))
          dt = time.perf_counter() - t0
          tr.state.step = rec.step
          if i < args.warmup:
            continue
          r, b = res[k], rec.batch
          r["tokens"] += float(b.loss_mask.sum())
          r["wall_s"] += dt - rec.out["time/compile_s"]
          r["rollout_s"] += rec.times["rollout"]  # the engine's share (compilation included)
          r["lengths"] += [len(c.token_ids) for c in b.completions]
          r["decode_steps"] += int(b.info.engine["decode_steps"])
          r["compile_s"] += rec.out["time/compile_s"]
          for name, t in rec.times.items():  # where the wall time goes, phase by phase,
            # less the compilation inside it
            r["phases"][name] = r["phases"].get(name, 0.0) + t - compiled.get(name, 0.0)
          for name, c in compiled.items():
            if c > 0:
              r["compile_by_phase"][name] = r["compile_by_phase"].get(name, 0.0) + c
          after = _engine_counts(tr)
          for name in _ENGINE_COUNTS:
            r["engine"][name] = r["engine"].get(name, 0.0) + after[name] - before[name]
          if modes[k]:  # the engine runs inside the producer's turn: its counters per step
            busy, idle = tr.producer.last_slot_steps
          else:
            busy, idle = tr.rollout.stats["busy_slot_steps"], tr.rollout.stats["idle_slot_steps"]
          r["busy"], r["idle"] = r["busy"] + busy, r["idle"] + idle
    finally:
      for tr in trs.values():
        tr.close()
  for r in res.values():
    r["tokens_per_s"] = r["tokens"] / r["wall_s"]
    r["occupancy"] = r["busy"] / max(r["busy"] + r["idle"], 1)
    r["tokens_per_decode_step"] = r["tokens"] / max(r["decode_steps"], 1)
  return res


def _compile_timed(out: dict, name: str, fn):
  """`Trainer.run_step`'s phase wrapper: the compilation seconds inside each phase."""
  from sparrow_jax.run import compile_clock

  def run(rec):
    c0 = compile_clock.seconds()
    try:
      return fn(rec)
    finally:
      out[name] = out.get(name, 0.0) + compile_clock.seconds() - c0
  return run


# Engine counters summed per mode over the timed steps: prefill calls, decode chunks, and the
# seconds the host waited for the device (the rest of the rollout phase is host work).
_ENGINE_COUNTS = ("prefills", "decode_chunks", "device_wait_s")


def _engine_counts(tr) -> dict[str, float]:
  """The engine's cumulative counters (the session's, or the engine's own across rollouts)."""
  ro = tr.rollout
  if ro.session is not None:
    c = ro.session.run.counts
  else:
    c = tr.engine.stats
  return {k: float(c.get(k, 0)) for k in _ENGINE_COUNTS}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=8, help="timed steps per mode (>= 6)")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
  p.add_argument("--median", type=float, default=24.0, help="median response length")
  p.add_argument("--max-new", type=int, default=192, help="max_new_tokens (the law's cap)")
  p.add_argument("--prompts", type=int, default=4, help="prompts_per_step")
  p.add_argument("--group", type=int, default=8, help="group_size")
  p.add_argument("--chunk", type=int, default=8, help="decode_chunk")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--length-buckets", type=int, default=1,
                 help="length_buckets_per_octave of the learner's padded lengths (1: powers "
                      "of two, so the timed steps compile nothing new; the preset's 8 "
                      "compiles a new update program in most timed steps)")
  p.add_argument("--staleness", type=int, default=1,
                 help="max_staleness of the asynchronous run (the issue's comparison: 1)")
  p.add_argument("--smoke", action="store_true", help="a few short steps (tests)")
  args = p.parse_args(argv)
  if args.smoke:
    args.steps, args.warmup, args.median, args.max_new, args.prompts = 2, 1, 4.0, 24, 2
  res = run_modes(args, {"sync": 0, "async": args.staleness})
  for name, r in res.items():
    print(f"{name}: {r['tokens']:.0f} trained tokens in {r['wall_s']:.2f} s = "
          f"{r['tokens_per_s']:.1f} tokens/s, {r['decode_steps']} decode steps "
          f"({r['tokens_per_decode_step']:.2f} tokens each), occupancy {r['occupancy']:.3f}, "
          f"rollout {r['rollout_s']:.2f} s of it",
          flush=True)
  for name, r in res.items():
    ph = ", ".join(f"{p} {t:.2f}" for p, t in sorted(r["phases"].items(), key=lambda x: -x[1])
                   if t >= 0.005)
    e = r["engine"]
    cb = ", ".join(f"{p} {t:.2f}" for p, t in sorted(r["compile_by_phase"].items(),
                                                      key=lambda x: -x[1]))
    print(f"{name} phases (s over the timed steps, less compilation; compiled: "
          f"{cb or 'nothing'}): {ph}; "
          f"engine: {e.get('prefills', 0):.0f} prefills, {e.get('decode_chunks', 0):.0f} "
          f"decode chunks, {e.get('device_wait_s', 0):.2f} s waiting for the device",
          flush=True)
  lens = np.asarray(res["sync"]["lengths"] + res["async"]["lengths"], np.float64)
  p50, p90, p99 = np.percentile(lens, [50, 90, 99])
  print(f"response lengths (trained rows of both modes, n={lens.size}): p50 {p50:.0f}, "
        f"p90 {p90:.0f}, p99 {p99:.0f}, p99/p50 {p99 / p50:.2f} (law: sigma {SIGMA}, "
        f"median {args.median:g}, cap {args.max_new})", flush=True)
  out = {"sync_tokens_per_s": res["sync"]["tokens_per_s"],
         "async_tokens_per_s": res["async"]["tokens_per_s"],
         "ratio": res["async"]["tokens_per_s"] / res["sync"]["tokens_per_s"],
         "sync_occupancy": res["sync"]["occupancy"],
         "async_occupancy": res["async"]["occupancy"], "p99_over_p50": p99 / p50,
         "p50": p50, "p90": p90, "p99": p99, "timed_steps": args.steps,
         # load-free: trained tokens per decode step (the device work of the rollouts)
         "decode_step_ratio": (res["async"]["tokens_per_decode_step"]
                               / res["sync"]["tokens_per_decode_step"]),
         "max_staleness": args.staleness, "smoke": args.smoke,
         "length_buckets_per_octave": args.length_buckets, "seed": args.seed,
         "phases": {k: r["phases"] for k, r in res.items()},
         "compile_by_phase": {k: r["compile_by_phase"] for k, r in res.items()},
         "engine": {k: r["engine"] for k, r in res.items()}}
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
