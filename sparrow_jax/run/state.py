"""The training state: one pytree that a step takes and returns, and a checkpoint saves.

    step            RL steps done
    params          the dense policy (nnx.State)
    opt_state       its optimizer state
    ref_params      the KL reference (kl_coef > 0), else None
    lora            the sparse actor's LoRA (DistillSparse), else None
    lora_opt_state  its optimizer state
    policy_version  how many times the learner has handed new weights to the rollout engine
                    (once per RL step); each token records the version that sampled it
    bad_steps       consecutive steps with a non-finite loss or gradient
    warmstart_done  the supervised warm start ran
    data            the prompt stream's position (`PromptDataset.state_dict()`)
    seed            sampling keys are fold_in(key(request_seed(seed, step, round, prompt,
                    sample)), position): with the step they fix every random draw

Arrays are pytree children; the rest is static metadata. The checkpoint layout is the one runs
wrote before this module existed: arrays under `params`, `opt_state`, `ref_params`, `lora`,
`lora_opt_state` (absent when None), scalars in the metadata JSON (`policy_version` is new and
optional: older checkpoints resume with the step as the version, which is what it equals in
synchronous training).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

_ARRAY_FIELDS = ("params", "opt_state", "ref_params", "lora", "lora_opt_state")


@dataclasses.dataclass
class TrainState:
  step: int
  params: Any
  opt_state: Any
  ref_params: Any = None
  lora: Any = None
  lora_opt_state: Any = None
  policy_version: int = 0
  bad_steps: int = 0
  warmstart_done: bool = False
  data: dict | None = None
  seed: int = 0

  def replace(self, **kw) -> "TrainState":
    return dataclasses.replace(self, **kw)

  def checkpoint_arrays(self) -> dict[str, Any]:
    """The array part as checkpoints store it (None fields left out)."""
    return {k: getattr(self, k) for k in _ARRAY_FIELDS if getattr(self, k) is not None}

  def checkpoint_metadata(self) -> dict[str, Any]:
    return {"step": self.step, "data": self.data, "bad_steps": self.bad_steps,
            "warmstart_done": self.warmstart_done, "policy_version": self.policy_version,
            "rng": {"seed": self.seed, "scheme": "per-request fold_in(seed, position)"}}

  def restored(self, arrays: dict[str, Any], meta: dict[str, Any]) -> "TrainState":
    """This state with a checkpoint's arrays and metadata (fields a checkpoint lacks keep
    their values here)."""
    step = int(meta["step"])
    kw = {k: arrays[k] for k in _ARRAY_FIELDS if k in arrays}
    return self.replace(step=step, bad_steps=int(meta.get("bad_steps", 0)),
                        warmstart_done=bool(meta.get("warmstart_done", step > 0)),
                        policy_version=int(meta.get("policy_version", step)),
                        data=meta.get("data", self.data), **kw)


jax.tree_util.register_dataclass(
    TrainState, data_fields=list(_ARRAY_FIELDS),
    meta_fields=["step", "policy_version", "bad_steps", "warmstart_done", "data", "seed"])
