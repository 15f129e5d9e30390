"""Shared driver of the "resume continues exactly" trainer tests."""

from sparrow_jax.run.metrics import read_jsonl
from sparrow_jax.run.trainer import Trainer


def comparable(rec):
  """A metrics record without its wall-clock fields (they differ between any two runs)."""
  return {k: v for k, v in rec.items()
          if not k.startswith("time/") and k not in ("rollout/tokens_per_s", "compilations")}


def full_and_interrupted(make_cfg, tmp, total: int, split: int, *flags):
  """Run `total` steps in tmp/full and `split` steps in tmp/part. Returns (full, part,
  resumed): `resumed` is a fresh trainer on tmp/part set for `total` steps, not yet resumed."""
  full = Trainer(make_cfg(tmp / "full", f"num_steps={total}", *flags), quiet=True)
  full.fit()
  part = Trainer(make_cfg(tmp / "part", f"num_steps={split}", *flags), quiet=True)
  part.fit()
  resumed = Trainer(make_cfg(tmp / "part", f"num_steps={total}", *flags), quiet=True)
  return full, part, resumed


def assert_same_metrics(tmp, steps):
  """The full and the resumed run logged the same metrics at `steps`; returns both logs."""
  a = read_jsonl(str(tmp / "full" / "metrics.jsonl"))
  b = read_jsonl(str(tmp / "part" / "metrics.jsonl"))
  for step in steps:
    assert comparable(a[step]) == comparable(b[step]), step
  return a, b
