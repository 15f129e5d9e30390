"""One training step of a preset, phase by phase, beside what this machine can do.

    python benchmarks/step_profile.py                          # smollm2_135m, 3 steps
    python benchmarks/step_profile.py --steps 2 max_new_tokens=256 prompts_per_step=2
    python benchmarks/step_profile.py --config smollm2_135m_study --profile /tmp/prof

The step is the trainer's own (`Trainer.run_step` over its pipeline, times from the
StepRecord's `rec.times`); this script only adds two things around every stage:

* compile time, from jax's own compile events (tracing, lowering, XLA backend compile), so
  that a stage's time is shown with compilation apart: step 1 compiles almost everything; a
  stage that compiles again in later steps has a shape that is not bucketed (issue 22);
* a FLOP and byte model of the work each phase did in that step, from the step's real shapes
  (prompt and response lengths of its rollouts, the micro-batch plans, the engine's decode
  steps), next to this machine's measured float32 matmul rate and memory bandwidth (a
  model-shaped matmul and a sum over 256 MB, median of 5).

The model (matmul FLOPs, 2 per multiply-add, attention included; bytes read or written):
  forward of R x L tokens: 2 x (layers x per-layer matmul params + LM head) per token, plus
    causal attention 2 x 2 x layers x heads x head_dim x L / 2 per token; bytes: the weights
    once, the activations (12 x hidden + 4 x MLP width floats per token and layer) and the
    LM head's logits three times (write, log-softmax, gather) per token.
  rollout: the prefill as a forward over the prompts; each decode step reads all weights
    once and the K/V held by its sequences; 2 x params x new tokens FLOPs.
  recompute: a forward over the logprob plan's padded tokens (0 when it is skipped).
  update: 3 forwards (4 with remat) over the update plan's padded tokens, plus Adam reading
    parameters, gradients and both moments and writing three of them.
It is an order-of-magnitude model, meant to say which phase is far from the machine's rate
and whether it is bound by arithmetic or by bytes; XLA's own view of the worst phase comes
from `--profile DIR` (a `jax.profiler` trace of that stage in one more step, for TensorBoard /
xprof).

Rows: steps 2.. are "steady" (median over them); step 1 is printed apart. Load average is
printed: on a shared machine compare runs side by side only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


class CompileClock:
  """Seconds jax spent tracing, lowering and compiling since it was installed."""

  def __init__(self):
    self.seconds = 0.0
    self.events = 0

    def listener(event, duration, **_):
      if event in _COMPILE_EVENTS:
        self.seconds += duration
        self.events += event == _COMPILE_EVENTS[-1]

    jax.monitoring.register_event_duration_secs_listener(listener)


# --- this machine ---------------------------------------------------------------------------

def _median_time(fn, *args, repeats: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def machine_rates(hidden: int, mlp: int) -> dict[str, float]:
  """float32 matmul FLOP/s (the best of a model-shaped [4096, hidden] x [hidden, mlp] and a
  square 2048 product) and memory bandwidth (bytes/s of a sum over 256 MB)."""
  rng = np.random.default_rng(0)
  out = {}
  best = 0.0
  for m, k, n in ((4096, hidden, mlp), (2048, 2048, 2048)):
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    s = _median_time(jax.jit(jnp.matmul), a, b)
    best = max(best, 2 * m * k * n / s)
  out["flops"] = best
  # A streaming read (what weights and K/V reads are); a pass that writes a fresh buffer
  # would mostly time the kernel's first-touch page faults on this VM.
  x = jnp.ones((64 << 20,), jnp.float32)  # 256 MB
  s = _median_time(jax.jit(jnp.sum), x)
  out["bytes"] = x.nbytes / s
  return out


# --- the work model -------------------------------------------------------------------------

def model_terms(mc) -> dict[str, float]:
  d, f = mc.hidden_size, mc.intermediate_size
  per_layer = d * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + \
      mc.num_heads * mc.head_dim * d + 3 * d * f
  return dict(layer_params=per_layer, lm_params=mc.vocab_size * d, layers=mc.num_layers,
              attn=2 * 2 * mc.num_layers * mc.num_heads * mc.head_dim,
              act_floats=mc.num_layers * (12 * d + 4 * f), vocab=mc.vocab_size,
              kv_token_bytes=2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4)


def forward_work(m: dict, rows: int, length: int, param_bytes: int,
                 head: int | None = None) -> tuple[float, float]:
  """(FLOPs, bytes) of one teacher-forced forward over rows x length tokens, the LM head over
  `head` positions per row (the response window; default all)."""
  tok = rows * length
  head_tok = rows * min(head or length, length)
  flops = tok * (2 * m["layers"] * m["layer_params"] + m["attn"] * length / 2) + \
      head_tok * 2 * m["lm_params"]
  nbytes = param_bytes + 4 * tok * m["act_floats"] + 4 * head_tok * 3 * m["vocab"]
  return flops, nbytes


def phase_work(tr, sb, m: dict, param_bytes: int) -> dict[str, tuple[float, float]]:
  """{phase: (FLOPs, bytes)} of the work one step did (see the module docstring)."""
  comps = sb.batch.info.completions + list(sb.batch.info.pruned)
  out = {}
  # Rollout: prefill of every prompt + decode of every new token.
  fl = by = 0.0
  for c in comps:
    f, b = forward_work(m, 1, len(c.prompt_ids), 0)
    fl, by = fl + f, by + b
  new = sum(len(c.token_ids) for c in comps)
  ctx = np.mean([len(c.prompt_ids) + len(c.token_ids) / 2 for c in comps]) if comps else 0
  fl += new * (2 * (m["layers"] * m["layer_params"] + m["lm_params"]) + m["attn"] * ctx)
  steps = sb.batch.info.engine.get("decode_steps", 0)
  by += steps * param_bytes + new * ctx * m["kv_token_bytes"]
  out["rollout"] = (fl, by)
  lengths = sb.batch.lengths
  # The LM head's window (run/programs.py), where this checkout's programs have one.
  import inspect
  from sparrow_jax.run import programs
  head = (tr.cfg.max_new_tokens if "response_window" in
          inspect.signature(programs.make_grad_step).parameters else None)
  if not tr.programs.skip_recompute:
    out["recompute"] = tuple(map(sum, zip(*[forward_work(m, mb.rows, mb.length, param_bytes,
                                                         head)
                                            for mb in sb.logprob_plan])))
  else:
    out["recompute"] = (0.0, 0.0)
  passes = 4 if tr.cfg.remat else 3
  fl = by = 0.0
  for s in range(0, len(lengths), tr.cfg.mini_batch):
    for mb in tr.learner.update_plan(lengths[s:s + tr.cfg.mini_batch]):
      f, b = forward_work(m, mb.rows, mb.length, param_bytes, head)
      fl, by = fl + passes * f, by + passes * b
    by += 7 * param_bytes  # Adam: read p, g, m, v; write p, m, v
  out["update"] = (fl * tr.cfg.ppo_epochs, by * tr.cfg.ppo_epochs)
  return out


# --- the step -------------------------------------------------------------------------------

def stage_wrapper(clock: CompileClock, record: dict, profile: tuple[str, str] | None = None):
  """A `wrap(name, fn)` for `Trainer.run_step`: every phase of the step records its compile
  seconds and compile events into `record[name]`; `profile=(stage, dir)` traces that stage."""

  def wrap(name, fn):
    def run(rec):
      s0, e0 = clock.seconds, clock.events
      ctx = (jax.profiler.trace(profile[1]) if profile and profile[0] == name
             else contextlib.nullcontext())
      with ctx:
        fn(rec)
      record[name] = (clock.seconds - s0, clock.events - e0)
    return run

  return wrap


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="smollm2_135m", help="training preset")
  ap.add_argument("--steps", type=int, default=3, help="steps (1 = warm-up; >= 2)")
  ap.add_argument("--profile", default=None, metavar="DIR",
                  help="one more step with the slowest stage under jax.profiler.trace(DIR)")
  ap.add_argument("overrides", nargs="*", help="key=value config overrides")
  args = ap.parse_intermixed_args(argv)
  if args.steps < 2:
    print(f"error: --steps={args.steps}; expected >= 2 (step 1 compiles)", file=sys.stderr)
    return 2

  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.trainer import Trainer

  clock = CompileClock()
  out_dir = tempfile.mkdtemp(prefix="step_profile_")
  cfg = get_train_config(args.config, [f"out_dir={out_dir}", *args.overrides])
  t0 = time.perf_counter()
  tr = Trainer(cfg, quiet=True)
  build_s = time.perf_counter() - t0
  mc = tr.model_cfg
  m = model_terms(mc)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(tr.params))
  rates = machine_rates(mc.hidden_size, mc.intermediate_size)
  print(f"# {time.strftime('%Y-%m-%d %H:%M')}  jax {jax.__version__}  "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)  load "
        f"{os.getloadavg()[0]:.1f}  preset {args.config} {' '.join(args.overrides)}")
  print(f"# model {mc.name} ({cfg.dtype}), {param_bytes / 1e6:.0f} MB of parameters; "
        f"trainer built in {build_s:.1f} s; machine: float32 matmul "
        f"{rates['flops'] / 1e9:.1f} GFLOP/s, memory {rates['bytes'] / 1e9:.1f} GB/s; "
        f"recompute {'skipped (redundant)' if tr.programs.skip_recompute else 'runs'}")

  steps = []  # per step: (sb, {stage: (compile s, compiles)})
  with tr:
    for _ in range(args.steps):
      record = {}
      sb = tr.run_step(wrap=stage_wrapper(clock, record))
      steps.append((sb, record))
      print(f"# step {sb.step}: {sb.out['time/step_s']:.1f} s, "
            f"{sum(c for c, _ in record.values()):.1f} s compiling, "
            f"{int(np.sum(sb.batch.lengths))} tokens in {len(sb.batch.lengths)} rows, "
            f"responses {sb.out['response/len_mean']:.0f} mean / "
            f"{sb.out['response/len_max']} max, {sb.out['batch/micro_batches']} update "
            f"micro-batches, padding {sb.out['batch/padding_frac']:.0%}", flush=True)
    profile_dir = None
    steady = steps[1:]
    med = lambda xs: statistics.median(xs) if xs else 0.0
    names = [n for n, _ in tr.pipeline()]
    # `generate` is rollout + reward in the StepRecord's times: show them apart.
    rows = ["rollout", "reward"] + [n for n in names if n != "generate"]
    stage_of = {"rollout": "generate", "reward": "generate"}
    t_of = lambda sb, n: sb.times.get(n, 0.0)
    work = [phase_work(tr, sb, m, param_bytes) for sb, _ in steady]
    print("\n| phase | step 1 s | steady s | compile s (step 1 / steady) | compiles (steady) | "
          "GFLOP | GFLOP/s | % of matmul rate | GB | GB/s | % of bandwidth |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    worst, worst_s = None, -1.0
    for n in rows:
      st = stage_of.get(n, n)
      first = t_of(steps[0][0], n)
      s = med([t_of(sb, n) for sb, _ in steady])
      c1 = steps[0][1].get(st, (0.0, 0))[0]
      cs = med([r.get(st, (0.0, 0))[0] for _, r in steady])
      ns = med([r.get(st, (0.0, 0))[1] for _, r in steady])
      comp = f"{c1:.1f} / {cs:.1f} | {ns:.0f}"
      if n == "reward":  # generate's compile time is on the rollout row
        comp = "- | -"
      if n != "reward" and s > worst_s:
        worst, worst_s = st, s
      if s < 0.05 and first < 0.05:
        continue
      cell = "| - | - | - | - | - | - |"
      if n in ("rollout", "recompute", "update") and s > 0:
        fl = med([w[n][0] for w in work])
        by = med([w[n][1] for w in work])
        cell = (f"| {fl / 1e9:.0f} | {fl / s / 1e9:.1f} | {100 * fl / s / rates['flops']:.0f}% "
                f"| {by / 1e9:.1f} | {by / s / 1e9:.1f} | "
                f"{100 * by / s / rates['bytes']:.0f}% |")
      print(f"| {n} | {first:.2f} | {s:.2f} | {comp} {cell}")
    total = med([sb.out["time/step_s"] for sb, _ in steady])
    print(f"| step | {steps[0][0].out['time/step_s']:.2f} | {total:.2f} | "
          f"{sum(c for c, _ in steps[0][1].values()):.1f} / "
          f"{med([sum(c for c, _ in r.values()) for _, r in steady]):.1f} | "
          f"{med([sum(e for _, e in r.values()) for _, r in steady]):.0f} "
          "| - | - | - | - | - | - |")
    if args.profile:
      profile_dir = os.path.abspath(args.profile)
      record = {}
      sb = tr.run_step(wrap=stage_wrapper(clock, record, (worst, profile_dir)))
      print(f"\n# profile of stage {worst!r} ({sb.times.get(worst, 0.0):.1f} s in step "
            f"{sb.step}) written to {profile_dir} (tensorboard --logdir / xprof)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
