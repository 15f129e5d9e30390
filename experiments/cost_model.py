"""Price a sparsity schedule: dense vs block-sparse rollout eFLOPs, bytes, roofline time.

Three modes (see `sparrow_jax/schedule/cost_model.py` for the accounting):

  one schedule (default):
    python experiments/cost_model.py --config qwen3_1p7b --schedule qwen3-1.7b-0.86 \
        --prompt-len 512 --gen-len 32768 --batch 64 [--gpu-bw 4.8e12 --gpu-flops 989e12] [--json]
  the paper's Table 2 comparison (published 0.86 schedules of Qwen3-1.7B/4B/8B/14B):
    python experiments/cost_model.py --paper-table [--batches 1,16,64,256] [--gen-len 32768]
  page sizes from an alpha table (CSV columns page_size,bin,budget,p5):
    python experiments/cost_model.py --alpha-table p5.csv --tau 0.86 --bin-size 2048 ...

Bad arguments exit with code 2 and a message naming the argument.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparrow_jax.models.config import PRESETS as MODEL_PRESETS, get_config
from sparrow_jax.schedule import cost_model as cm
from sparrow_jax.schedule.presets import parse_schedule
from sparrow_jax.schedule.schedule import describe

from experiments._cli import int_list, positive

# Paper Table 2 (4xH200, AIME24 x8, 32K cutoff, tau = 0.86): (config, schedule, rollout, RL step)
PAPER_TABLE2 = (
    ("qwen3_1p7b", "qwen3-1.7b-0.86", 2.21, 1.97),
    ("qwen3_4b", "qwen3-4b-0.86", 2.41, 2.11),
    ("qwen3_8b", "qwen3-8b-0.86", 2.06, 1.81),
    ("qwen3_14b", "qwen3-14b-0.86", 1.48, 1.35),
)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="qwen3_1p7b",
                 help=f"model preset, one of {sorted(MODEL_PRESETS)}")
  p.add_argument("--schedule", default="qwen3-1.7b-0.86",
                 help="preset name, schedule .json path, constant:K or dense")
  p.add_argument("--prompt-len", type=int, default=512, help="L_in tokens (>= 0)")
  p.add_argument("--gen-len", type=positive(int), default=32768, help="L_gen tokens")
  p.add_argument("--batch", type=positive(int), default=64, help="sequences decoded together")
  p.add_argument("--gpu-bw", type=positive(float), default=cm.GPUSpec().mem_bandwidth,
                 help="memory bandwidth, bytes/s (H200: 4.8e12)")
  p.add_argument("--gpu-flops", type=positive(float), default=cm.GPUSpec().peak_flops,
                 help="peak FLOP/s (H200 dense bf16: 989e12)")
  p.add_argument("--bytes-per-element", type=positive(int), default=2)
  p.add_argument("--landmark-dtype", default="float32", choices=("float32", "bfloat16"),
                 help="dtype the KV cache keeps page landmarks in (TrainConfig landmark_dtype)")
  p.add_argument("--topk-ops", type=float, default=1.0,
                 help="top-k eFLOPs per candidate page per KV head")
  p.add_argument("--no-lm-head", action="store_true", help="leave the LM head out of P")
  p.add_argument("--json", action="store_true", help="print JSON instead of a table")
  p.add_argument("--paper-table", action="store_true",
                 help="predicted speedups of the published 0.86 schedules vs paper Table 2")
  p.add_argument("--batches", type=int_list, default=None,
                 help="with --paper-table: comma-separated batch sizes (default: --batch)")
  p.add_argument("--alpha-table", default=None,
                 help="CSV page_size,bin,budget,p5: compare page sizes 16/32/64/128")
  p.add_argument("--tau", type=float, default=0.86, help="with --alpha-table: p5 target")
  p.add_argument("--bin-size", type=positive(int), default=2000,
                 help="with --alpha-table: tokens per bin of the table")
  return p


def _fmt(x: float) -> str:
  return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.3e}"


def _single(args, cfg, gpu, kw) -> dict:
  sched = parse_schedule(args.schedule)
  sp = cm.rollout_speedup(cfg, sched, prompt_len=args.prompt_len, gen_len=args.gen_len,
                          batch=args.batch, gpu=gpu, **kw)
  d, s = sp["dense"], sp["sparse"]
  rows = [("decode eFLOPs", d.flops, s.flops)]
  rows += [(f"  {k}", d.flops_by_part[k], s.flops_by_part[k]) for k in d.flops_by_part]
  rows += [("decode bytes", d.bytes, s.bytes)]
  rows += [(f"  {k}", d.bytes_by_part[k], s.bytes_by_part[k]) for k in d.bytes_by_part]
  rows += [("decode time (s)", d.decode_time_s, s.decode_time_s),
           ("prefill time (s)", d.prefill_time_s, s.prefill_time_s),
           ("rollout time (s)", d.time_s, s.time_s),
           ("tokens/s", d.tokens_per_s, s.tokens_per_s),
           ("memory-bound steps", d.memory_bound_steps, s.memory_bound_steps)]
  return {"config": cfg.name, "schedule": describe(sched), "gpu": gpu.name,
          "prompt_len": args.prompt_len, "gen_len": args.gen_len, "batch": args.batch,
          "time_speedup": sp["time_speedup"], "eflops_ratio": sp["eflops_ratio"],
          "bytes_ratio": sp["bytes_ratio"], "dense": d.to_dict(), "sparse": s.to_dict(),
          "_rows": rows}


def _print_single(res: dict) -> None:
  print(f"model {res['config']}  |  {res['schedule']}")
  print(f"prompt {res['prompt_len']}  gen {res['gen_len']}  batch {res['batch']}  "
        f"GPU {res['gpu']} (roofline)")
  print(f"{'quantity':<22}{'dense':>14}{'sparse':>14}{'dense/sparse':>14}")
  for name, dv, sv in res["_rows"]:
    ratio = f"{dv / sv:.3f}" if sv else "-"
    print(f"{name:<22}{_fmt(dv):>14}{_fmt(sv):>14}{ratio:>14}")
  print(f"predicted rollout speedup (roofline time): {res['time_speedup']:.3f}x   "
        f"eFLOP ratio: {res['eflops_ratio']:.3f}x")


def _paper(args, gpu, kw) -> list[dict]:
  batches = args.batches or [args.batch]
  out = []
  for cfg_name, sname, paper_rollout, paper_step in PAPER_TABLE2:
    cfg = get_config(cfg_name)
    sched = parse_schedule(sname)
    row = {"config": cfg_name, "schedule": sname, "paper_rollout_speedup": paper_rollout,
           "paper_rl_step_speedup": paper_step, "predicted_time_speedup": {}}
    for b in batches:
      sp = cm.rollout_speedup(cfg, sched, prompt_len=args.prompt_len, gen_len=args.gen_len,
                              batch=b, gpu=gpu, **kw)
      row["predicted_time_speedup"][b] = sp["time_speedup"]
      row["eflops_ratio"] = sp["eflops_ratio"]
      row[f"dense_tokens_per_s@{b}"] = sp["dense"].tokens_per_s
    out.append(row)
  return out


def _print_paper(rows: list[dict], args) -> None:
  batches = list(rows[0]["predicted_time_speedup"])
  print(f"prompt {args.prompt_len}, gen {args.gen_len}, roofline on one GPU "
        f"({args.gpu_bw:.3g} B/s, {args.gpu_flops:.3g} FLOP/s)")
  head = "| model | schedule | " + " | ".join(f"pred. time B={b}" for b in batches)
  print(head + " | pred. eFLOP ratio | paper rollout | paper RL step |")
  print("|---|---|" + "---|" * (len(batches) + 3))
  for r in rows:
    pred = " | ".join(f"{r['predicted_time_speedup'][b]:.2f}x" for b in batches)
    print(f"| {r['config']} | {r['schedule']} | {pred} | {r['eflops_ratio']:.2f}x | "
          f"{r['paper_rollout_speedup']:.2f}x | {r['paper_rl_step_speedup']:.2f}x |")


def _page_sizes(args, cfg, gpu, kw) -> list[dict]:
  return cm.compare_page_sizes(cfg, args.alpha_table, tau=args.tau, bin_size=args.bin_size,
                               prompt_len=args.prompt_len, gen_len=args.gen_len,
                               batch=args.batch, gpu=gpu, **kw)


def main(argv=None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.prompt_len < 0:
    parser.error(f"--prompt-len={args.prompt_len}: expected an int >= 0")
  if not 0.0 < args.tau <= 1.0:
    parser.error(f"--tau={args.tau}: expected a float in (0, 1]")
  if args.topk_ops < 0:
    parser.error(f"--topk-ops={args.topk_ops}: expected >= 0")
  if args.paper_table and args.alpha_table:
    parser.error("--paper-table and --alpha-table: expected at most one mode")
  try:
    gpu = cm.GPUSpec(name="custom" if (args.gpu_bw, args.gpu_flops) != (4.8e12, 989e12)
                     else "H200", mem_bandwidth=args.gpu_bw, peak_flops=args.gpu_flops,
                     bytes_per_element=args.bytes_per_element,
                     landmark_bytes_per_element=4 if args.landmark_dtype == "float32" else 2)
    kw = dict(include_lm_head=not args.no_lm_head, topk_ops_per_candidate=args.topk_ops)
    if args.paper_table:
      rows = _paper(args, gpu, kw)
      if args.json:
        print(json.dumps(rows, indent=2))
      else:
        _print_paper(rows, args)
      return 0
    cfg = get_config(args.config)
    if args.alpha_table:
      rows = _page_sizes(args, cfg, gpu, kw)
      if not rows:
        print(f"error: --alpha-table {args.alpha_table}: no rows for page sizes 16/32/64/128",
              file=sys.stderr)
        return 2
      if args.json:
        print(json.dumps(rows, indent=2))
      else:
        print(f"| page size | budgets per bin (pages) | max tokens | all bins reach tau "
              f"{args.tau} | pred. time speedup | eFLOP ratio |")
        print("|---|---|---|---|---|---|")
        for r in rows:
          print(f"| {r['page_size']} | {' '.join(map(str, r['budgets']))} | {r['tokens_max']} "
                f"| {r['all_bins_feasible']} | {r['time_speedup']:.2f}x | "
                f"{r['eflops_ratio']:.2f}x |")
      return 0
    res = _single(args, cfg, gpu, kw)
    if args.json:
      res.pop("_rows")
      print(json.dumps(res, indent=2))
    else:
      _print_single(res)
    return 0
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
