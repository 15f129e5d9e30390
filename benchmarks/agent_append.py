r"""Multi-turn rollouts two ways on one batch of a trained tool-use run: the engine session
that pauses a sequence at a tool call and appends the environment's tokens into its pages
(the agent loop's default) against rounds that re-prefill each trajectory's whole context
(`Request.context_ids`). Prints tokens prefilled and appended per trajectory, rollout wall
time and the time inside the engine's prefill and append calls (host + device, medians of
--repeats, the two paths alternating), and checks that both paths give the same
trajectories token for token.

    python benchmarks/agent_append.py --checkpoint runs/tiny_tools
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--checkpoint", required=True, help="a training out_dir with tools")
  ap.add_argument("--prompts", type=int, default=16, help="prompts (x group_size rollouts)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--step", type=int, default=1000, help="the sampling seeds' step")
  args = ap.parse_args(argv)

  import numpy as np
  from sparrow_jax.run import runs
  from sparrow_jax.run.builders import build_examples, fit_prompts
  from sparrow_jax.run.config import parse_overrides
  from sparrow_jax.run.producer import make_agent_loop
  from sparrow_jax.run.trainer import Trainer

  cfg = runs.run_config(args.checkpoint, parse_overrides(["tensorboard=false"]))
  if not cfg.tools:
    print(f"error: {args.checkpoint} was not trained with tools", file=sys.stderr)
    return 2
  trainer = Trainer(cfg, quiet=True, with_dataset=False)
  step = trainer.restore_weights(lora=False)
  examples = fit_prompts(trainer.tokenizer, build_examples(cfg), cfg, "data")[:args.prompts]
  reqs = trainer.producer.requests(examples, args.step)
  engine = trainer.rollout.engine
  agent = make_agent_loop(cfg, trainer.tokenizer)
  keys = ("prefill_tokens", "append_tokens", "recomputed_tokens", "preemptions",
          "decode_steps")
  spent = {"prefill": 0.0, "append": 0.0}  # seconds inside the engine's calls, per run

  def timed(name, fn):
    def call(*a, **kw):
      t0 = time.perf_counter()
      try:
        return fn(*a, **kw)
      finally:
        spent[name] += time.perf_counter() - t0
    return call
  engine._prefill = timed("prefill", engine._prefill)
  engine._append = timed("append", engine._append)

  def append_path():
    return agent.run(reqs, engine=engine), dict(engine.last_stats)

  def reprefill_path():
    total = dict.fromkeys(keys, 0)

    def generate(rs):
      out = engine.generate(rs)
      for k in keys:
        total[k] += engine.last_stats[k]
      return out
    return agent.run(reqs, generate), total

  runs_ = {"append": append_path, "re-prefill": reprefill_path}
  times = {k: [] for k in runs_}
  calls_s = {k: {"prefill": [], "append": []} for k in runs_}
  result = {}
  append_path()  # compile both paths' programs first
  reprefill_path()
  for _ in range(args.repeats):
    for name, fn in runs_.items():
      spent.update(prefill=0.0, append=0.0)
      t0 = time.perf_counter()
      result[name] = fn()
      times[name].append(time.perf_counter() - t0)
      for k in spent:
        calls_s[name][k].append(spent[k])
  (a, sa), (b, sb) = result["append"], result["re-prefill"]
  same = all(np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.loss_mask, y.loss_mask)
             for x, y in zip(a, b))
  lp = max(float(np.max(np.abs(x.logprobs - y.logprobs), initial=0)) for x, y in zip(a, b))
  n = len(reqs)
  env = sum(int((np.asarray(c.loss_mask) == 0).sum()) for c in a)
  calls = sum(r.tool_calls for r in agent.last_records)
  print(f"{args.checkpoint} step {step}: {n} trajectories, {sum(len(c.token_ids) for c in a) / n:.1f} "
        f"response tokens each ({env / n:.1f} environment), {calls / n:.2f} tool calls each")
  print(f"same trajectories: {same}; max |log-prob difference| {lp:.2e}")
  for name, st in (("append", sa), ("re-prefill", sb)):
    per = {k: st[k] / n for k in keys}
    print(f"{name:>10}: prefill {per['prefill_tokens']:.1f}  append {per['append_tokens']:.1f}  "
          f"recomputed {per['recomputed_tokens']:.1f} tokens/trajectory; decode steps "
          f"{st['decode_steps']}; wall {statistics.median(times[name]):.2f} s, in prefill "
          f"calls {statistics.median(calls_s[name]['prefill']) * 1e3:.0f} ms, in append calls "
          f"{statistics.median(calls_s[name]['append']) * 1e3:.0f} ms (medians of "
          f"{args.repeats})")
  written = lambda st: st["prefill_tokens"] + st["append_tokens"]
  print(f"tokens written into the KV per trajectory: re-prefill / append = "
        f"{written(sb) / n:.1f} / {written(sa) / n:.1f} = {written(sb) / written(sa):.2f}x")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
