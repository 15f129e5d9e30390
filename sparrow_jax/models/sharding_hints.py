"""Where the run's mesh wants the batch inside the model: activation sharding hints.

Under FSDP the weights are sharded, often along a matmul's contracting dimension. Given only
batch-sharded inputs, XLA's SPMD partitioner is free to keep a weight sharded and split the
matmul's contracting dimension instead, which leaves full-batch activations on every device
and all-reduces them (the memory then does not fall with more devices: `--dry-run --compile`
showed 71 GB per device for a 2-sequence-per-device update on 4 devices, against 53 GB for
the same per-device work on one). Constraining the residual stream and the LM head's logits
to the batch sharding makes the partitioner all-gather each layer's weights instead (ZeRO-3),
as FSDP intends.

The trainer's jitted programs trace their bodies inside `batch_sharding(mesh, axes)`; the
model calls `constrain_batch(x)` at the layer boundaries and on the logits. Outside such a
context (tests, the engine's per-device `shard_map` programs, single-device runs) it is the
identity. A batch the mesh axes do not divide is left alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

_BATCH: contextvars.ContextVar = contextvars.ContextVar("sparrow_batch_sharding", default=None)


@contextlib.contextmanager
def batch_sharding(mesh, axes: tuple[str, ...]):
  """While tracing inside this context, `constrain_batch` shards dim 0 over `axes` of `mesh`."""
  size = math.prod(mesh.shape[a] for a in axes)
  token = _BATCH.set((mesh, tuple(axes)) if size > 1 else None)
  try:
    yield
  finally:
    _BATCH.reset(token)


def hinted(fn, mesh, axes: tuple[str, ...]):
  """`fn` with its body traced inside `batch_sharding(mesh, axes)` (wrap before `jax.jit`)."""
  if mesh is None:
    return fn

  def wrapped(*args, **kwargs):
    with batch_sharding(mesh, axes):
      return fn(*args, **kwargs)
  wrapped.__name__ = getattr(fn, "__name__", "program")
  return wrapped


def constrain_batch(x):
  """`x` [B, ...] constrained to the batch sharding of the current context (else `x`)."""
  spec = _BATCH.get()
  if spec is None or x.ndim == 0:
    return x
  mesh, axes = spec
  if x.shape[0] % math.prod(mesh.shape[a] for a in axes):
    return x
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P(axes, *([None] * (x.ndim - 1)))))
