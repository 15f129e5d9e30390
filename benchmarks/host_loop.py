"""Host milliseconds per decode chunk against device milliseconds per chunk (issue 19).

    python benchmarks/host_loop.py                     # 256 slots, top-20 log-probs
    python benchmarks/host_loop.py --slots 64 --topk 8 --model smollm2_135m

A full batch of distinct random prompts (one per slot, lengths 16-64) generates at temperature
1 with a chunk of 16 decode steps and the top-k log-probs of every token kept (what the
trainer's mismatch monitor asks for), max_new_tokens drawn per request (so sequences end at
different chunks). After a compiling call, each variant runs `--repeats` timed generate calls:

  device ms / chunk   the decode program alone: a separate call with every chunk blocked on
                      right after dispatch (median over its chunks);
  host ms / chunk     (wall - time blocked in jax.device_get) / chunks: what the Python loop
                      costs per chunk (bookkeeping, page tables, transfers in);
  dispatch ms / chunk the part of it spent inside the call of the jitted decode step (on
                      XLA:CPU the call itself runs part of the work before returning), so
                      host - dispatch is the engine's own bookkeeping;
  wall ms / chunk     wall / chunks of the normal (unblocked) call.

Variants: `overlap` (the engine's default: the next chunk is dispatched before the host
reads the previous one when nothing is queued) and `sync` (`overlap_chunks=False`: the same
array bookkeeping, no overlap). The script only uses what every engine version has
(`generate`, `_get_decode`, `last_stats`), so it also measures an older checkout of the engine
(`PYTHONPATH=<old checkout>`), whose per-token loop then shows as one `sync` row.
The weights are random (speed does not depend on their values).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402


def _requests(n: int, vocab: int, max_new: int, seed: int = 0):
  from sparrow_jax.engine.engine import Request
  from sparrow_jax.engine.sampling import SamplingParams
  rng = np.random.default_rng(seed)
  return [Request(list(rng.integers(3, vocab, int(rng.integers(16, 65)))),
                  SamplingParams(temperature=1.0, ignore_eos=True, seed=i,
                                 max_new_tokens=int(rng.integers(max_new // 2, max_new + 1))),
                  i) for i in range(n)]


class _Blocked:
  """Wraps jax.device_get and counts the seconds it blocks."""

  def __init__(self):
    self.seconds, self._orig = 0.0, jax.device_get

  def __enter__(self):
    def timed(x):
      t0 = time.perf_counter()
      out = self._orig(x)
      self.seconds += time.perf_counter() - t0
      return out
    jax.device_get = timed
    return self

  def __exit__(self, *exc):
    jax.device_get = self._orig


def device_ms_per_chunk(engine, reqs) -> float:
  """Median ms of one decode call, blocked on right after dispatch."""
  times = []
  get = engine._get_decode

  def spy(*a, **k):
    fn = get(*a, **k)
    def call(*args):
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t0)
      return out
    return call

  engine._get_decode = spy
  try:
    engine.generate(reqs)
  finally:
    engine._get_decode = get
  return 1e3 * statistics.median(times)


def _timed_dispatch(engine, spent: list):
  """Wraps the engine's decode-step builder so every call's (non-blocking) time is kept."""
  get = engine._get_decode

  def spy(*a, **k):
    fn = get(*a, **k)
    def call(*args):
      t0 = time.perf_counter()
      out = fn(*args)
      spent.append(time.perf_counter() - t0)
      return out
    return call

  engine._get_decode = spy
  return get


def measure(engine, reqs, repeats: int) -> dict:
  engine.generate(reqs)  # compiles
  device = device_ms_per_chunk(engine, reqs)
  host, wall, blocked, dispatch, chunks = [], [], [], [], 0
  for _ in range(repeats):
    spent = []
    get = _timed_dispatch(engine, spent)
    try:
      with _Blocked() as b:
        t0 = time.perf_counter()
        engine.generate(reqs)
        w = time.perf_counter() - t0
    finally:
      engine._get_decode = get
    chunks = engine.last_stats["decode_chunks"]
    host.append(1e3 * (w - b.seconds) / chunks)
    wall.append(1e3 * w / chunks)
    blocked.append(1e3 * b.seconds / chunks)
    dispatch.append(1e3 * sum(spent) / chunks)
  return dict(chunks=chunks, device_ms=device, host_ms=statistics.median(host),
              dispatch_ms=statistics.median(dispatch),
              wall_ms=statistics.median(wall), blocked_ms=statistics.median(blocked),
              overlapped=engine.last_stats.get("overlapped_chunks", 0),
              tokens=engine.last_stats["generated_tokens"])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="tiny", help="ModelConfig preset (random weights)")
  ap.add_argument("--layers", type=int, default=None, help="override the preset's layers")
  ap.add_argument("--slots", type=int, default=256)
  ap.add_argument("--topk", type=int, default=20)
  ap.add_argument("--chunk", type=int, default=16)
  ap.add_argument("--max-new", type=int, default=96)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--label", default="", help="tag printed with every row (e.g. a commit)")
  args = ap.parse_args(argv)
  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine
  from sparrow_jax.models.config import get_config
  from sparrow_jax.models.decoder import init_model

  over = {"num_layers": args.layers} if args.layers else {}
  mc = get_config(args.model, eos_token_ids=(), **over)
  model = init_model(mc)
  base = dict(num_slots=args.slots, max_seq_len=64 + args.max_new + 1, page_size=16,
              decode_chunk=args.chunk, logprobs_topk=args.topk)
  fields = {f.name for f in dataclasses.fields(EngineConfig)}
  variants = ([("overlap", dict(overlap_chunks=True)), ("sync", dict(overlap_chunks=False))]
              if "overlap_chunks" in fields else [("sync", {})])
  reqs = _requests(args.slots, mc.vocab_size, args.max_new)
  print(f"# {mc.name} ({mc.num_layers} layers, vocab {mc.vocab_size}), {args.slots} slots, "
        f"top-{args.topk} log-probs, chunk {args.chunk}, max_new <= {args.max_new}, "
        f"median of {args.repeats}; load {os.getloadavg()[0]:.1f}")
  print("| label | variant | chunks | tokens | device ms/chunk | host ms/chunk | of it dispatch "
        "| wall ms/chunk | blocked ms/chunk | overlapped |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name, extra in variants:
    eng = GenerationEngine(model, EngineConfig(**base, **extra))
    r = measure(eng, reqs, args.repeats)
    print(f"| {args.label} | {name} | {r['chunks']} | {r['tokens']} | {r['device_ms']:.1f} "
          f"| {r['host_ms']:.1f} | {r['dispatch_ms']:.1f} | {r['wall_ms']:.1f} "
          f"| {r['blocked_ms']:.1f} "
          f"| {r['overlapped']} |", flush=True)
    del eng
  return 0


if __name__ == "__main__":
  sys.exit(main())
