"""How busy can the engine's slots be at `max_staleness=N`? A simulation of the producer's
admission and readiness rules on `async_throughput.py`'s workload, with no learner time and no
host overheads (so it bounds what the benchmark can measure from above).

    python benchmarks/async_occupancy_sim.py                  # the benchmark's shapes, N = 1, 2
    python benchmarks/async_occupancy_sim.py --staleness 1 --steps 400 --median 64

The engine: `slots` sequence slots, decode chunks of `chunk` tokens; a request admitted into a
free slot samples its first token at once (the prefill) under the engine's current version,
then one token per decode step; a slot whose sequence finishes mid-chunk idles to the chunk's
end. Occupancy = busy / all slot-steps of the decode chunks (the benchmark's `occupancy`).
Response lengths: lognormal(log median, 0.75) capped, one per request, as in the benchmark.

Modes (prompts_per_step = P groups of G requests per step):
  sync         every step admits its P groups and decodes until all finish (max_staleness=0).
  per_token    the producer's rule (run/async_producer.py): at most (N+1) x P groups
               outstanding; a step at version V takes P finished groups, oldest first, and
               waits while fewer are finished or while an unfinished group holds a token of
               version <= V - N (it would be N + 1 versions old at the next step); the
               engine's turn ends with one more chunk. Every trained token is <= N old.
  admission    AReaL's capacity rule alone (its `max_head_offpolicyness`; also tinker's
               `sampling_steps_ahead`): the same (N+1) x P cap on groups admitted and not
               yet trained, the step takes the P oldest finished groups as soon as P are
               finished. Nothing bounds a trained token's age: a group that outlives the
               others is trained when it finishes, however old (`max_age` reports it).

The last stdout line is JSON: per mode the occupancy, trained tokens per decode step and
max / mean token age (versions) of the trained tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

SIGMA = 0.75


@dataclasses.dataclass
class _Seq:
  group: int
  length: int
  done: int = 0  # tokens generated
  first_version: int | None = None
  versions: list = dataclasses.field(default_factory=list)


def _lengths(rng, n, median, cap):
  z = rng.standard_normal(n)
  return np.minimum(np.maximum(np.round(median * np.exp(SIGMA * z)), 1), cap).astype(int)


def simulate(mode: str, *, staleness: int = 1, prompts: int = 4, group: int = 8,
             slots: int = 32, chunk: int = 8, median: float = 24.0, cap: int = 192,
             steps: int = 200, seed: int = 0) -> dict:
  """One run of `mode` for `steps` learner steps (module docstring)."""
  rng = np.random.default_rng(seed)
  version, busy, idle, decode_steps = 0, 0, 0, 0
  queue: list[_Seq] = []
  running: list[_Seq] = []
  groups: dict[int, list[_Seq]] = {}  # outstanding: admitted (drawn) and not trained
  draws, trained_tokens, ages = 0, 0, []
  limit = 1 if mode == "sync" else staleness + 1

  def draw():
    nonlocal draws
    for _ in range(prompts):
      key = draws
      draws += 1
      seqs = [_Seq(key, int(n)) for n in _lengths(rng, group, median, cap)]
      groups[key] = seqs
      queue.extend(seqs)

  def finished(key):
    return all(s.done >= s.length for s in groups[key])

  def admit():
    while queue and len(running) < slots:
      s = queue.pop(0)
      s.first_version = version
      s.versions.append(version)
      s.done = 1
      if s.done < s.length:
        running.append(s)

  def chunk_step():
    nonlocal busy, idle, decode_steps
    admit()
    for _ in range(chunk):
      if not running:
        break
      decode_steps += 1
      live = [s for s in running if s.done < s.length]
      busy += len(live)
      idle += slots - len(live)
      for s in live:
        s.done += 1
        s.versions.append(version)
    running[:] = [s for s in running if s.done < s.length]

  def blocked():
    if mode in ("sync", "admission"):
      return False
    return any(not finished(k) and any(s.first_version is not None and
                                       s.first_version <= version - staleness for s in seqs)
               for k, seqs in groups.items())

  for _ in range(steps):
    while True:
      while len(groups) + prompts <= limit * prompts:
        draw()
      done = [k for k in groups if finished(k)]
      if mode == "sync":
        ready = len(done) == len(groups)
      else:
        ready = len(done) >= prompts and not blocked()
      if ready:
        break
      chunk_step()
    if mode == "per_token" and (running or queue):
      chunk_step()  # the engine's turn ends with one more chunk (the producer does so)
    done = [k for k in groups if finished(k)]
    done.sort(key=lambda k: (min(s.first_version for s in groups[k]), k))
    for k in done[:prompts]:
      for s in groups.pop(k):
        trained_tokens += s.length
        ages.extend(version - v for v in s.versions)
    version += 1
  ages = np.asarray(ages)
  return {"occupancy": busy / max(busy + idle, 1),
          "tokens_per_decode_step": trained_tokens / max(decode_steps, 1),
          "max_age": int(ages.max()), "mean_age": float(ages.mean()),
          "frac_age_over_n": float(np.mean(ages > staleness))}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
  p.add_argument("--prompts", type=int, default=4)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--slots", type=int, default=None, help="default prompts x group")
  p.add_argument("--chunk", type=int, default=8)
  p.add_argument("--median", type=float, default=24.0)
  p.add_argument("--max-new", type=int, default=192)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--seeds", type=int, default=3)
  args = p.parse_args(argv)
  slots = args.slots or args.prompts * args.group
  out = {}
  for n in args.staleness:
    for mode in ("sync", "per_token", "admission"):
      runs = [simulate(mode, staleness=n, prompts=args.prompts, group=args.group, slots=slots,
                       chunk=args.chunk, median=args.median, cap=args.max_new,
                       steps=args.steps, seed=s) for s in range(args.seeds)]
      r = {k: float(np.mean([x[k] for x in runs])) for k in runs[0]}
      r["max_age"] = max(x["max_age"] for x in runs)
      out[f"{mode}_n{n}" if mode != "sync" else "sync"] = r
      print(f"N={n} {mode:<10} occupancy {r['occupancy']:.3f}, trained tokens per decode "
            f"step {r['tokens_per_decode_step']:.2f}, token age mean {r['mean_age']:.2f} max "
            f"{r['max_age']} (share > N: {r['frac_age_over_n']:.3f})", flush=True)
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
