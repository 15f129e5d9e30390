"""The trainer's no-grad recompute against its update, side by side in one process.

    python benchmarks/recompute.py                     # SmolLM2-135M preset's step shapes
    python benchmarks/recompute.py --rows 16 --length 256 --fill 170 --topk 20

Both programs are the ones `run/trainer.py` jits, at the SmolLM2 preset's shapes (16 rollouts
of ~170 tokens padded to the 256-token bucket, top-20 log-probs for the monitor):

* `recompute`: `token_logprobs(..., topk=k)` without gradient (old log-probs + the monitor's
  dense top-k), and the same without top-k (what the top-k costs);
* `update`: what the trainer's `update` runs: value and gradient of a GRPO-style token-mean
  loss of `token_logprobs` (forward + backward; `--remat` as the preset sets it), then the
  preset's optimizer step (`run.builders.make_optimizer`, `run.programs.guarded_apply`), with
  parameters and optimizer state donated as the trainer donates them.

Each is compiled ahead of time (compile seconds printed apart), then the calls are timed in
alternation (A B A B ...) so load on a shared machine hits both alike; medians of `--repeats`.
Beside each time: the matmul FLOPs of the program (2 x params x tokens for a forward, 3x that
for forward + backward, attention included) and the rate it reaches; the acceptance line of
issue 22 is recompute / update <= 0.45 and the recompute's GFLOP/s at least the update's.
Random weights: speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def forward_flops(mc, rows: int, length: int) -> float:
  """Matmul FLOPs of one teacher-forced forward over rows x length tokens (causal attention
  counted as the full-key chunks of today's path would not: T^2 / 2 per head)."""
  d, f = mc.hidden_size, mc.intermediate_size
  per_layer = d * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + \
      mc.num_heads * mc.head_dim * d + 3 * d * f
  dense = 2 * (mc.num_layers * per_layer + mc.vocab_size * d)  # per token, LM head included
  attn = 2 * 2 * mc.num_layers * mc.num_heads * mc.head_dim * length / 2  # QK^T + PV, causal
  return rows * length * (dense + attn)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="smollm2_135m", help="model preset (shape)")
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--length", type=int, default=256, help="padded sequence length (bucket)")
  ap.add_argument("--fill", type=int, default=170, help="valid tokens per row (mean)")
  ap.add_argument("--topk", type=int, default=20)
  ap.add_argument("--chunk", type=int, default=128, help="logprob_chunk")
  ap.add_argument("--remat", action="store_true")
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)

  from flax import nnx
  from sparrow_jax.models.config import get_config
  from sparrow_jax.run.builders import make_optimizer
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.models.decoder import init_model
  from sparrow_jax.rl.logprobs import token_logprobs
  from sparrow_jax.run.programs import guarded_apply

  mc = get_config(args.config)
  model = init_model(mc)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  b, t = args.rows, args.length
  lengths = np.clip(rng.normal(args.fill, args.fill / 8, b).astype(np.int32), 2, t)
  tokens = rng.integers(3, mc.vocab_size, (b, t)).astype(np.int32)
  tokens[np.arange(t)[None, :] >= lengths[:, None]] = 0
  mask = (np.arange(t)[None, :] >= 128) & (np.arange(t)[None, :] < lengths[:, None])
  tokens, lengths, mask = jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(mask)
  adv = jnp.asarray(rng.normal(size=(b,)).astype(np.float32))

  def recompute(p, tokens, lengths, topk):
    st = token_logprobs(nnx.merge(graphdef, p), tokens, lengths=lengths, chunk=args.chunk,
                        topk=topk)
    return st.logp, st.topk_ids, st.topk_logp

  def loss(p, tokens, lengths):
    st = token_logprobs(nnx.merge(graphdef, p), tokens, lengths=lengths, chunk=args.chunk,
                        remat=args.remat)
    ratio = jnp.exp(st.logp - jax.lax.stop_gradient(st.logp))
    m = mask.astype(jnp.float32)
    return -jnp.sum(ratio * adv[:, None] * m) / jnp.sum(m)

  tx, _ = make_optimizer(get_train_config("smollm2_135m"))

  def update(p, opt_state, tokens, lengths):
    val, grads = jax.value_and_grad(loss)(p, tokens, lengths)
    p, opt_state, ok, gnorm = guarded_apply(tx, p, opt_state, grads, val)
    return p, opt_state, val, gnorm

  opt_state = jax.jit(tx.init)(params)
  fresh = lambda: (jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state))
  progs = {
      f"recompute top-{args.topk}": (jax.jit(recompute, static_argnums=3),
                                     (params, tokens, lengths, args.topk), 1),
      "recompute no top-k": (jax.jit(recompute, static_argnums=3),
                             (params, tokens, lengths, 0), 1),
      "update (fwd+bwd+opt)": (jax.jit(update, donate_argnums=(0, 1)),
                               (*fresh(), tokens, lengths), 3 + (1 if args.remat else 0)),
  }
  compiled, compile_s = {}, {}
  for name, (fn, a, _) in progs.items():
    t0 = time.perf_counter()
    compiled[name] = fn.lower(*a).compile()
    compile_s[name] = time.perf_counter() - t0
  times = {k: [] for k in progs}
  for _ in range(args.repeats + 1):
    for name, (fn, a, _) in progs.items():
      if name.startswith("update"):
        call_args = (*fresh(), tokens, lengths)  # donated: new buffers every call
        jax.block_until_ready(call_args)
      else:
        call_args = a[:3]  # the static top-k is baked into the compiled program
      t0 = time.perf_counter()
      jax.block_until_ready(compiled[name](*call_args))
      times[name].append(time.perf_counter() - t0)
  fl = forward_flops(mc, b, t)
  print(f"# {time.strftime('%Y-%m-%d %H:%M')}  jax {jax.__version__}  "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)  load "
        f"{os.getloadavg()[0]:.1f}  model {mc.name} ({mc.dtype})  {b} x {t} tokens "
        f"(~{args.fill} valid), chunk {args.chunk}, remat {args.remat}; median of "
        f"{args.repeats} after a warm-up call\n")
  print("| program | compile s | ms | GFLOP | GFLOP/s |")
  print("|---|---|---|---|---|")
  med = {}
  for name, (_, _, mult) in progs.items():
    med[name] = statistics.median(times[name][1:])
    print(f"| {name} | {compile_s[name]:.1f} | {1e3 * med[name]:.0f} | {mult * fl / 1e9:.0f} | "
          f"{mult * fl / med[name] / 1e9:.1f} |")
  rk = f"recompute top-{args.topk}"
  print(f"\nrecompute / update: {med[rk] / med['update (fwd+bwd+opt)']:.2f} (issue 22 asks <= 0.45); "
        f"top-k share of the recompute: {1 - med['recompute no top-k'] / med[rk]:.0%}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
