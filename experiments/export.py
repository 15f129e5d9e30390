r"""Export a trained policy as a Hugging Face directory: config.json, model.safetensors and the
tokenizer (with its chat template) beside them.

    python experiments/export.py --checkpoint runs/tiny                  # -> runs/tiny/hf
    python experiments/export.py --checkpoint runs/tiny --out /tmp/tiny_hf --dtype bfloat16

The newest intact checkpoint of the training out_dir is read (policy weights only).
transformers loads the result (`AutoModelForCausalLM.from_pretrained(dir)`,
`AutoTokenizer.from_pretrained(dir)`), and so do `experiments/generate.py --model-path DIR`
and `load_pretrained` / `load_tokenizer`.
The tiny model's byte tokenizer is written as a `tokenizer.json` transformers reads, plus
`sparrow_tokenizer.json`, from which our own loaders rebuild the exact `ByteTokenizer`.
Training with `export_hf=true` writes the same directory at the end of the run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--checkpoint", required=True, help="a training out_dir")
  ap.add_argument("--out", default=None, help="output directory (default: CHECKPOINT/hf)")
  ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                  help="stored weight dtype (default: the run's export_dtype, else its "
                       "param_dtype)")
  from experiments._cli import show_defaults
  show_defaults(ap)
  args = ap.parse_args(argv)

  from sparrow_jax.models import save_pretrained
  from sparrow_jax.run.runs import load_run_policy
  try:
    pol = load_run_policy(args.checkpoint, report=lambda m: print(m, file=sys.stderr))
    out = args.out or os.path.join(args.checkpoint, "hf")
    files = save_pretrained(pol.model, out, overwrite=True, tokenizer=pol.tokenizer,
                            dtype=args.dtype or pol.cfg.export_dtype)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported step {pol.step} of {args.checkpoint} to {out}: {', '.join(files)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
