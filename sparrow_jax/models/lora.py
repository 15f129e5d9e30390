"""LoRA adapters of the sparse rollout actor (DistillSparse, paper §4.5).

The sparse actor is the dense policy *plus* a low-rank adapter that only the rollout and the
distillation step see: `W x + scale * (x A) B` on the projections named in `targets`, with
`scale = alpha / rank`. The adapter is its own pytree (`lora`), passed to the decoder as an
argument; it is never merged into the policy and never part of the policy's parameter tree, so
the dense recompute and the GRPO update cannot depend on it (DESIGN.md decision 1).

Tree layout (what `Decoder._apply_lora` reads):

  {"layers": [ {name: {"a": A, "b": B, "scale": LoRAScale}, ...}  # one dict per layer
             ]}                                                   # {} = no adapter there

  name    A                          B
  q       [D, r]                     [r, N, H]
  k, v    [D, r]                     [r, K, H]
  o       [N, H, r]                  [r, D]
  gate,up [D, r]                     [r, F]
  down    [F, r]                     [r, D]

with D hidden size, N query heads, K kv heads, H head dim, F intermediate size, r rank.
A is random (normal, std `init_std`, default 1/sqrt(fan_in)), B is zero, so a fresh adapter
leaves every logit bitwise unchanged. Adapters are float32 whatever the model's dtypes.

`scale` is configuration, not a parameter: `LoRAScale` is a *static* pytree node (no leaves),
so `jax.tree.leaves(lora)`, gradients, optimizer states and checkpoints hold A and B only, and
jit treats the scale as a compile-time constant.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from sparrow_jax.models.config import ModelConfig

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

LoRATree = dict[str, Any]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class LoRAScale:
  """alpha / rank as a static pytree node: multiplies arrays, carries no leaf."""

  value: float

  def __mul__(self, x):
    return x * self.value

  __rmul__ = __mul__

  def __float__(self) -> float:
    return float(self.value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
  """Adapter shape: rank r, alpha (scale = alpha / r), target projections, adapted layers.

  `layers=None` adapts every layer; otherwise a tuple of layer indices. `init_std=None` draws
  A with std 1/sqrt(fan_in) (fan_in = D for q/k/v/gate/up, N*H for o, F for down).
  """

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = TARGETS
  layers: tuple[int, ...] | None = None
  init_std: float | None = None

  def __post_init__(self):
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
      raise ValueError(f"LoRAConfig.rank={self.rank!r}: expected a positive int")
    if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or \
        not self.alpha > 0:
      raise ValueError(f"LoRAConfig.alpha={self.alpha!r}: expected a float > 0")
    object.__setattr__(self, "alpha", float(self.alpha))
    if isinstance(self.targets, str):
      object.__setattr__(self, "targets", tuple(t for t in self.targets.split(",") if t))
    targets = tuple(self.targets)
    for t in targets:
      if t not in TARGETS:
        raise ValueError(f"LoRAConfig.targets contains unknown target {t!r}: expected a "
                         f"subset of {TARGETS}")
    if not targets:
      raise ValueError(f"LoRAConfig.targets=(): expected at least one of {TARGETS}")
    if len(set(targets)) != len(targets):
      raise ValueError(f"LoRAConfig.targets={targets!r}: expected no duplicates")
    object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))
    if self.layers is not None:
      layers = tuple(self.layers)
      for i in layers:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
          raise ValueError(f"LoRAConfig.layers={self.layers!r}: expected layer indices >= 0 "
                           "or None (all layers)")
      if len(set(layers)) != len(layers):
        raise ValueError(f"LoRAConfig.layers={self.layers!r}: expected no duplicates")
      object.__setattr__(self, "layers", tuple(sorted(layers)))
    if self.init_std is not None and not (isinstance(self.init_std, (int, float))
                                          and self.init_std > 0):
      raise ValueError(f"LoRAConfig.init_std={self.init_std!r}: expected None or a float > 0")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def adapted_layers(self, model_cfg: ModelConfig) -> tuple[int, ...]:
    """Layer indices that carry adapters; refuses indices past the model's depth."""
    n = model_cfg.num_layers
    if self.layers is None:
      return tuple(range(n))
    bad = [i for i in self.layers if i >= n]
    if bad:
      raise ValueError(f"LoRAConfig.layers={self.layers!r}: layer(s) {bad} do not exist in a "
                       f"{n}-layer model (expected indices < {n})")
    return self.layers

  def num_params(self, model_cfg: ModelConfig) -> int:
    """Exact number of adapter parameters (A and B) for this model."""
    per_layer = sum(math.prod(a) + math.prod(b)
                    for a, b in (target_shapes(model_cfg, self.rank)[t] for t in self.targets))
    return per_layer * len(self.adapted_layers(model_cfg))


def target_shapes(model_cfg: ModelConfig, rank: int) -> dict[str, tuple[tuple, tuple]]:
  """(A shape, B shape) of every target (see the module docstring)."""
  d, n, k, h = (model_cfg.hidden_size, model_cfg.num_heads, model_cfg.num_kv_heads,
                model_cfg.head_dim)
  f, r = model_cfg.intermediate_size, rank
  return {
      "q": ((d, r), (r, n, h)),
      "k": ((d, r), (r, k, h)),
      "v": ((d, r), (r, k, h)),
      "o": ((n, h, r), (r, d)),
      "gate": ((d, r), (r, f)),
      "up": ((d, r), (r, f)),
      "down": ((f, r), (r, d)),
  }


def init_lora(model_cfg: ModelConfig, lora_cfg: LoRAConfig, key: jax.Array) -> LoRATree:
  """A fresh adapter tree: A ~ normal(0, init_std), B = 0 (float32)."""
  shapes = target_shapes(model_cfg, lora_cfg.rank)
  adapted = set(lora_cfg.adapted_layers(model_cfg))
  scale = LoRAScale(lora_cfg.scale)
  layers = []
  for i in range(model_cfg.num_layers):
    entry = {}
    if i in adapted:
      for t in lora_cfg.targets:
        a_shape, b_shape = shapes[t]
        fan_in = math.prod(a_shape[:-1])
        std = lora_cfg.init_std if lora_cfg.init_std is not None else fan_in ** -0.5
        a = std * jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, i),
                                                        TARGETS.index(t)), a_shape, jnp.float32)
        entry[t] = {"a": a, "b": jnp.zeros(b_shape, jnp.float32), "scale": scale}
    layers.append(entry)
  return {"layers": layers}


def lora_param_count(lora: LoRATree) -> int:
  """Number of adapter parameters in a tree (A and B; the static scale is not a leaf)."""
  return int(sum(x.size for x in jax.tree.leaves(lora)))


def check_lora(lora: LoRATree, model_cfg: ModelConfig) -> None:
  """Raise ValueError naming the first entry whose layout does not fit `model_cfg`."""
  if not isinstance(lora, dict) or "layers" not in lora:
    raise ValueError(f"lora tree: expected a dict with key 'layers', got {type(lora).__name__}")
  layers = lora["layers"]
  if len(layers) != model_cfg.num_layers:
    raise ValueError(f"lora['layers'] has {len(layers)} entries: expected one per layer "
                     f"({model_cfg.num_layers})")
  for i, entry in enumerate(layers):
    for t, pair in entry.items():
      if t not in TARGETS:
        raise ValueError(f"lora['layers'][{i}] has unknown target {t!r}: expected one of "
                         f"{TARGETS}")
      if set(pair) != {"a", "b", "scale"}:
        raise ValueError(f"lora['layers'][{i}][{t!r}] keys {sorted(pair)}: expected "
                         "['a', 'b', 'scale']")
      rank = pair["a"].shape[-1]
      a_shape, b_shape = target_shapes(model_cfg, rank)[t]
      if tuple(pair["a"].shape) != a_shape or tuple(pair["b"].shape) != b_shape:
        raise ValueError(f"lora['layers'][{i}][{t!r}] A {tuple(pair['a'].shape)}, B "
                         f"{tuple(pair['b'].shape)}: expected A {a_shape}, B {b_shape}")


def lora_norms(lora: LoRATree) -> dict[str, jax.Array]:
  """Global L2 norms of all A and all B matrices (B's norm shows how far the actor moved)."""
  a = [p["a"] for layer in lora["layers"] for p in layer.values()]
  b = [p["b"] for layer in lora["layers"] for p in layer.values()]
  sq = lambda xs: jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in xs))
  return {"a_norm": sq(a) if a else jnp.zeros(()), "b_norm": sq(b) if b else jnp.zeros(())}
