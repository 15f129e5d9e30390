"""Device mesh, partition rules and sharding helpers for training and rollout.

Mesh axes (always all three, in this order; a size-1 axis costs nothing):

  data    pure data parallelism: parameters and optimizer state are *replicated* across it;
          each replica sees a different slice of the batch.
  fsdp    fully-sharded data parallelism (ZeRO-3): parameters, gradients and optimizer state
          are *sharded* across it and all-gathered per layer by XLA; it also splits the batch.
  tensor  Megatron-style tensor parallelism: attention heads, the MLP width F and the vocab V
          are split across it.

The batch is split over ("data", "fsdp") on its leading dimension (`batch_sharding`).

Parameter partitioning is ONE regex table, `PARAM_RULES`, keyed by the axis-suffixed leaf names
of `decoder.py` (`q_DNH` is `[D, N, H]`: D -> fsdp, N -> tensor, H whole). A rule names, per
array dimension, a mesh axis (or a tuple of axes, or None). Two safety rules:

* a dimension whose size is not divisible by the product of its mesh axes falls back to
  *replicated for that dimension only* (e.g. SmolLM2's 9 heads on tensor=2); each fallback is
  returned by `param_specs` and logged by `param_shardings`, never hidden;
* a parameter path no rule matches raises `ValueError` (a new 10 GB leaf must never be
  silently replicated); pass `extra_rules` to mark it.

Optimizer state (`opt_state_specs` / `opt_state_shardings`): a leaf whose path ends in a
parameter's path and has that parameter's shape (AdamW mu/nu, nnx.Optimizer's OptState
variables) takes the parameter's spec; scalars (step counts, schedule state) are replicated;
anything else raises.

`make_mesh` builds an Auto-axis mesh (jax >= 0.7 defaults `jax.make_mesh` to Explicit axes,
under which `with_sharding_constraint` rejects plain specs). Joining a multi-host job is
`run/distributed.py`'s; `shard_batch` takes the same global host batch on every process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Marker for "replicate every dimension, whatever the rank" (norm scales, LoRA scale).
REPLICATED = "replicated"

# path regex (re.search on "layers/0/attn/q_DNH") -> per-dimension mesh axes, or REPLICATED.
# First match wins. Why these choices:
#  * D (hidden) is the FSDP dimension of every matrix: it is present in all of them, and for
#    every preset it divides 32 (1024, 2048, 2560, 4096, 5120; SmolLM2's 576 up to 64).
#  * heads N/K, the MLP width F and the vocab V go on tensor (column-parallel q/k/v/gate/up,
#    row-parallel o/down, vocab-parallel embedding and logits). `embed_VD` is (tensor, fsdp)
#    so that the tied-embedding logits einsum "...d,vd->...v" yields vocab-sharded logits
#    exactly like the untied `lm_head_DV` (fsdp, tensor).
#  * norm scales ([D] or [H]) are a few KB: replicated.
#  * LoRA (the decoder's `lora["layers"][i][proj] = {"a", "b", "scale"}`): `a` maps the
#    projection's input, `b` produces its output; each follows its base matrix so the rank
#    dimension r is never split. 14B at r=64 on all targets is ~0.26 B parameters, too big to
#    replicate with its AdamW state.
PARAM_RULES: tuple[tuple[str, Any], ...] = (
    (r"(^|/)embed_VD$", ("tensor", "fsdp")),
    (r"(^|/)lm_head_DV$", ("fsdp", "tensor")),
    (r"(^|/)q_DNH$", ("fsdp", "tensor", None)),
    (r"(^|/)[kv]_DKH$", ("fsdp", "tensor", None)),
    (r"(^|/)o_NHD$", ("tensor", None, "fsdp")),
    (r"(^|/)q_bias_NH$", ("tensor", None)),
    (r"(^|/)[kv]_bias_KH$", ("tensor", None)),
    (r"(^|/)(gate|up)_DF$", ("fsdp", "tensor")),
    (r"(^|/)down_FD$", ("tensor", "fsdp")),
    (r"(^|/)[qk]_norm/scale$", REPLICATED),
    (r"(^|/)(input_norm|post_attn_norm|final_norm)/scale$", REPLICATED),
    # LoRA factors: a [D, r] / [N, H, r] / [F, r];  b [r, N, H] / [r, K, H] / [r, D] / [r, F].
    (r"(^|/)(q|k|v|gate|up)/a$", ("fsdp", None)),
    (r"(^|/)o/a$", ("tensor", None, None)),
    (r"(^|/)down/a$", ("tensor", None)),
    (r"(^|/)(q|k|v)/b$", (None, "tensor", None)),
    (r"(^|/)(gate|up)/b$", (None, "tensor")),
    (r"(^|/)(o|down)/b$", (None, "fsdp")),
    (r"(^|/)(q|k|v|o|gate|up|down)/scale$", REPLICATED),
)


# ----------------------------------------------------------------------------- mesh config


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Sizes of the ("data", "fsdp", "tensor") mesh axes; one of them may be -1 (fill).

  The default is pure FSDP over every device.
  """

  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def __post_init__(self):
    for name in AXES:
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or (v < 1 and v != -1):
        raise ValueError(f"MeshConfig.{name}={v!r}: expected a positive int or -1 (fill)")
      object.__setattr__(self, name, int(v))
    fill = [a for a in AXES if getattr(self, a) == -1]
    if len(fill) > 1:
      raise ValueError(f"MeshConfig: at most one axis may be -1 (fill), got {fill}")

  @property
  def shape(self) -> tuple[int, int, int]:
    return tuple(getattr(self, a) for a in AXES)

  @property
  def is_resolved(self) -> bool:
    return -1 not in self.shape

  def axis_sizes(self) -> dict[str, int]:
    if not self.is_resolved:
      raise ValueError(f"{self} has a -1 axis: call .resolve(num_devices) first")
    return dict(zip(AXES, self.shape))

  def resolve(self, num_devices: int) -> "MeshConfig":
    """Concrete sizes for `num_devices`; the product must equal the device count."""
    if num_devices < 1:
      raise ValueError(f"num_devices={num_devices}: expected >= 1")
    known = math.prod(s for s in self.shape if s != -1)
    sizes = dict(zip(AXES, self.shape))
    if not self.is_resolved:
      fill = next(a for a in AXES if sizes[a] == -1)
      if num_devices % known:
        raise ValueError(
            f"mesh {self.describe()}: the fixed axes' product {known} does not divide the "
            f"device count {num_devices}, so {fill}=-1 cannot fill it")
      sizes[fill] = num_devices // known
    elif known != num_devices:
      raise ValueError(
          f"mesh {self.describe()}: the product of the axis sizes is {known} but there are "
          f"{num_devices} devices; expected them equal (use -1 on one axis to fill)")
    return MeshConfig(**sizes)

  def describe(self) -> str:
    return ",".join(f"{a}={getattr(self, a)}" for a in AXES)


def parse_mesh(spec: str | None) -> MeshConfig:
  """Parse `--mesh`: "data=2,fsdp=4" (missing axes are 1), "2x4x1" (data x fsdp x tensor),
  or "" / "auto" / None for the default (pure FSDP). -1 fills one axis with the rest."""
  if spec is None or spec.strip().lower() in ("", "auto"):
    return MeshConfig()
  s = spec.strip()
  if "=" in s:
    sizes: dict[str, int] = {}
    for part in s.split(","):
      part = part.strip()
      if not part:
        continue
      if "=" not in part:
        raise ValueError(f"--mesh {spec!r}: item {part!r} is not name=size")
      name, val = (x.strip() for x in part.split("=", 1))
      if name not in AXES:
        raise ValueError(f"--mesh {spec!r}: unknown axis {name!r}; expected one of {AXES}")
      if name in sizes:
        raise ValueError(f"--mesh {spec!r}: axis {name!r} given twice")
      sizes[name] = _parse_int(val, f"--mesh {spec!r}: {name}")
    for a in AXES:
      sizes.setdefault(a, 1)
    return MeshConfig(**sizes)
  parts = [p.strip() for p in s.lower().split("x")]
  if len(parts) != len(AXES):
    raise ValueError(f"--mesh {spec!r}: expected 3 sizes DATAxFSDPxTENSOR (e.g. 2x4x1) or "
                     f"name=size pairs over {AXES}")
  return MeshConfig(**{a: _parse_int(p, f"--mesh {spec!r}: {a}") for a, p in zip(AXES, parts)})


def _parse_int(val: str, what: str) -> int:
  try:
    return int(val)
  except ValueError:
    raise ValueError(f"{what}={val!r}: expected an integer (or -1 to fill)") from None


def make_mesh(mesh_cfg: MeshConfig | str | None = None,
              devices: Sequence[Any] | None = None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh with Auto axis types over `devices` (default: all)."""
  if not isinstance(mesh_cfg, MeshConfig):
    mesh_cfg = parse_mesh(mesh_cfg)
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_cfg.resolve(len(devices)).shape
  axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
  try:
    return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)
  except (TypeError, NotImplementedError):
    # Older/newer signatures or device kinds make_mesh cannot order: plain row-major mesh.
    arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, AXES, axis_types=axis_types)


def mesh_axis_sizes(mesh: Mesh | MeshConfig | Mapping[str, int]) -> dict[str, int]:
  """{axis: size} of a Mesh, a resolved MeshConfig or a plain mapping (for dry runs)."""
  if isinstance(mesh, Mesh):
    return dict(mesh.shape)
  if isinstance(mesh, MeshConfig):
    return mesh.axis_sizes()
  sizes = {str(k): int(v) for k, v in mesh.items()}
  for a, v in sizes.items():
    if v < 1:
      raise ValueError(f"mesh axis {a}={v}: expected >= 1")
  return sizes


# ----------------------------------------------------------------------------- paths and rules


def path_str(path: Sequence[Any]) -> str:
  """"layers/0/attn/q_DNH" from a jax key path (nnx Variable `.value` and `.raw_value`
  attributes dropped, so nnx.State and its pure-dict form give the same strings)."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      if k.name in ("value", "raw_value"):
        continue
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class Fallback:
  """One dimension that was left replicated because its size does not divide its axes."""

  path: str
  dim: int
  size: int
  axes: tuple[str, ...]
  axes_size: int

  def __str__(self):
    return (f"{self.path} dim {self.dim} (size {self.size}) not divisible by "
            f"{'x'.join(self.axes)}={self.axes_size}: replicated")


def summarize_fallbacks(fallbacks: Iterable[Fallback]) -> list[str]:
  """One line per distinct (leaf name, dimension), layer indices collapsed to `*`."""
  groups: dict[tuple, int] = {}
  for fb in fallbacks:
    key = (re.sub(r"/\d+/", "/*/", fb.path), fb.dim, fb.size, fb.axes, fb.axes_size)
    groups[key] = groups.get(key, 0) + 1
  return [f"{p} dim {d} (size {s}) not divisible by {'x'.join(a)}={n}: replicated"
          + (f" [{c} leaves]" if c > 1 else "")
          for (p, d, s, a, n), c in groups.items()]


def _shape_of(x) -> tuple[int, ...]:
  return tuple(getattr(x, "shape", np.shape(x)))


def entry_axes(entry) -> tuple[str, ...]:
  """Mesh axes of one PartitionSpec entry (None, "fsdp" or ("data", "fsdp"))."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _hashable(rules) -> tuple:
  return tuple((pat, spec if spec == REPLICATED else
                tuple(tuple(e) if isinstance(e, list) else e for e in spec))
               for pat, spec in rules)


@functools.lru_cache(maxsize=64)
def _compiled(rules: tuple) -> tuple:
  out = []
  for pattern, spec in rules:
    if spec != REPLICATED:
      seen = [a for e in spec for a in entry_axes(e)]
      if len(seen) != len(set(seen)):
        raise ValueError(f"partition rule {pattern!r}: mesh axis used twice in {spec}")
    out.append((re.compile(pattern), spec))
  return tuple(out)


def spec_for(path: str, shape: Sequence[int], axis_sizes: Mapping[str, int],
             rules: Sequence[tuple[str, Any]] = PARAM_RULES) -> tuple[P, list[Fallback]]:
  """PartitionSpec of one leaf and the dimensions that fell back to replicated."""
  for rx, spec in _compiled(_hashable(rules)):
    if not rx.search(path):
      continue
    if spec == REPLICATED:
      return P(*([None] * len(shape))), []
    if len(spec) != len(shape):
      raise ValueError(f"partition rule {rx.pattern!r} gives {len(spec)} dims {spec} but "
                       f"{path} has shape {tuple(shape)}; expected one entry per dimension")
    entries, fallbacks = [], []
    for d, (size, entry) in enumerate(zip(shape, spec)):
      axes = entry_axes(entry)
      for a in axes:
        if a not in axis_sizes:
          raise ValueError(f"partition rule {rx.pattern!r} names mesh axis {a!r}; the mesh "
                           f"has {tuple(axis_sizes)}")
      n = math.prod(axis_sizes[a] for a in axes)
      if axes and size % n:
        fallbacks.append(Fallback(path, d, int(size), axes, n))
        entry = None
      entries.append(entry)
    return P(*entries), fallbacks
  raise ValueError(f"no partition rule matches parameter {path!r} (shape {tuple(shape)}); "
                   f"add one to sharding.PARAM_RULES or pass extra_rules=[(regex, spec)]")


def _is_spec(x) -> bool:
  return isinstance(x, P)


def param_specs(tree, mesh: Mesh | MeshConfig | Mapping[str, int], *,
                extra_rules: Iterable[tuple[str, Any]] = ()) -> tuple[Any, list[Fallback]]:
  """PartitionSpec for every leaf of a parameter pytree (nnx.State, its pure dict, arrays or
  ShapeDtypeStructs); returns (tree of PartitionSpec, fallbacks). Needs no devices when
  `mesh` is a MeshConfig or {axis: size} mapping."""
  sizes = mesh_axis_sizes(mesh)
  rules = tuple(extra_rules) + PARAM_RULES
  fallbacks: list[Fallback] = []

  def one(path, leaf):
    spec, fb = spec_for(path_str(path), _shape_of(leaf), sizes, rules)
    fallbacks.extend(fb)
    return spec

  return jax.tree_util.tree_map_with_path(one, tree), fallbacks


def _named(specs, mesh: Mesh):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def param_shardings(tree, mesh: Mesh, *, extra_rules: Iterable[tuple[str, Any]] = ()):
  """Tree of NamedSharding matching `tree` (an nnx.State, pure dict or abstract state).

  Dimensions that fell back to replicated are logged at INFO level.
  """
  specs, fallbacks = param_specs(tree, mesh, extra_rules=extra_rules)
  for line in summarize_fallbacks(fallbacks):
    log.info("sharding fallback: %s", line)
  return _named(specs, mesh)


def opt_state_specs(opt_state, param_spec_tree, params_abstract=None):
  """Specs for an optax (or nnx.Optimizer) state: moments follow their parameter's spec.

  A leaf whose key path ends in a parameter's path takes that parameter's spec if the shapes
  agree (checked when `params_abstract` is given, else by the spec's rank); scalars are
  replicated; any other leaf raises ValueError.
  """
  spec_leaves = jax.tree_util.tree_flatten_with_path(param_spec_tree, is_leaf=_is_spec)[0]
  by_path: dict[tuple[str, ...], tuple[P, tuple[int, ...] | None]] = {}
  shapes: dict[str, tuple[int, ...]] = {}
  if params_abstract is not None:
    for p, leaf in jax.tree_util.tree_flatten_with_path(params_abstract)[0]:
      shapes[path_str(p)] = _shape_of(leaf)
  for p, spec in spec_leaves:
    if not isinstance(spec, P):
      spec = spec.spec  # a NamedSharding
    key = path_str(p)
    by_path[tuple(key.split("/"))] = (spec, shapes.get(key))

  def one(path, leaf):
    shape = _shape_of(leaf)
    parts = tuple(path_str(path).split("/"))
    for i in range(len(parts)):
      hit = by_path.get(parts[i:])
      if hit is None:
        continue
      spec, pshape = hit
      if (pshape is not None and pshape == shape) or (pshape is None and len(spec) == len(shape)):
        return spec
    if len(shape) == 0:
      return P()
    raise ValueError(f"optimizer state leaf {path_str(path)!r} (shape {shape}) matches no "
                     f"parameter of the same shape; expected moments shaped like params")

  return jax.tree_util.tree_map_with_path(one, opt_state)


def opt_state_shardings(opt_state_abstract, param_specs_tree, mesh: Mesh, params_abstract=None):
  """NamedSharding tree for an optimizer state (see `opt_state_specs`)."""
  specs = opt_state_specs(opt_state_abstract, param_specs_tree, params_abstract)
  return _named(specs, mesh)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over ("data", "fsdp"); other dimensions replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_divisor(mesh: Mesh | MeshConfig | Mapping[str, int]) -> int:
  """How many shards the batch dimension is split into (data x fsdp)."""
  sizes = mesh_axis_sizes(mesh)
  return math.prod(sizes[a] for a in BATCH_AXES)


def shard_batch(batch, mesh: Mesh):
  """Place a host (numpy or jax) batch pytree with `batch_sharding`.

  `batch` is the global batch, identical on every process (multi-process runs gather the
  completions first): each process fills its own devices' rows from it
  (`jax.make_array_from_callback`), so nothing crosses hosts.
  """
  sharding = batch_sharding(mesh)
  div = batch_divisor(mesh)
  multi = jax.process_count() > 1

  def one(path, x):
    shape = _shape_of(x)
    if not shape:
      raise ValueError(f"batch leaf {path_str(path)!r} is a scalar; expected a leading batch dim")
    if shape[0] % div:
      raise ValueError(f"batch leaf {path_str(path)!r}: batch size {shape[0]} is not divisible "
                       f"by data x fsdp = {div}")
    if multi:
      host = np.asarray(x)
      return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.device_put(x, sharding)

  return jax.tree_util.tree_map_with_path(one, batch)


def shard_tree(tree, shardings):
  """`jax.device_put(tree, shardings)`: arrays moved/resharded onto the given shardings."""
  return jax.device_put(tree, shardings)


def abstract_with_shardings(abstract_tree, shardings):
  """ShapeDtypeStructs carrying `shardings` (for restoring a checkpoint onto a mesh)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(_shape_of(a), a.dtype, sharding=s),
                      abstract_tree, shardings)


def sharded_init(init_fn: Callable[[], Any], mesh: Mesh, *,
                 extra_rules: Iterable[tuple[str, Any]] = ()):
  """Initialise a pytree (e.g. `lambda: nnx.split(init_model(cfg))[1]`) directly sharded.

  The shapes come from `jax.eval_shape`, so no device ever holds the whole tree. Returns
  (tree, shardings).
  """
  abstract = jax.eval_shape(init_fn)
  shardings = param_shardings(abstract, mesh, extra_rules=extra_rules)
  tree = jax.jit(init_fn, out_shardings=shardings)()
  return tree, shardings
