"""Paged KV cache (device pytree) and its host-side page allocator.

Layout (DESIGN.md §3), stacked over layers L:
  k, v:        [L, K, P, S, D]   one physical page = S contiguous tokens of one kv head
  landmarks:   ()                 no landmarks (dense attention only)
               ([L, K, P, D],)    "mean": mean key of the tokens written in the page
               ([L, K, P, D],)*2  "quest": per-channel (min, max) of the keys written so far
  page_table:  [B, M] int32       logical page j of slot b -> physical page id
  lengths:     [B] int32          tokens held by slot b

Physical page 0 is the *null page*: never handed out by the allocator. Page-table entries past
a sequence's pages, padding rows of a prefill and inactive decode slots all point at it, so
their writes land somewhere harmless and their reads are masked by `lengths`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparrow_jax.pallas_kernels import selection


NULL_PAGE = 0
LANDMARK_KINDS = ("none", "mean", "quest")


@struct.dataclass
class PagedKVCache:
  k: jax.Array  # [L, K, P, S, D]
  v: jax.Array  # [L, K, P, S, D]
  landmarks: tuple  # () | (mean,) | (min, max); each [L, K, P, D] float32
  page_table: jax.Array  # [B, M] int32
  lengths: jax.Array  # [B] int32
  landmark_kind: str = struct.field(pytree_node=False, default="none")

  @classmethod
  def create(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
             num_pages: int, max_pages_per_seq: int, page_size: int = 16,
             dtype=jnp.float32, landmark: str = "none") -> "PagedKVCache":
    if landmark not in LANDMARK_KINDS:
      raise ValueError(f"landmark={landmark!r}: expected one of {LANDMARK_KINDS}")
    if page_size <= 0 or page_size & (page_size - 1):
      raise ValueError(f"page_size={page_size}: expected a positive power of two")
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    lm_shape = (num_layers, num_kv_heads, num_pages, head_dim)
    n_lm = {"none": 0, "mean": 1, "quest": 2}[landmark]
    return cls(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
        landmarks=tuple(jnp.zeros(lm_shape, jnp.float32) for _ in range(n_lm)),
        page_table=jnp.zeros((num_slots, max_pages_per_seq), jnp.int32),
        lengths=jnp.zeros((num_slots,), jnp.int32), landmark_kind=landmark)

  @property
  def page_size(self) -> int:
    return self.k.shape[3]

  @property
  def num_slots(self) -> int:
    return self.page_table.shape[0]

  def layer(self, i: int):
    """(k_pages, v_pages, landmarks) of layer i: `[K, P, S, D]` x2 and a tuple of `[K, P, D]`."""
    return self.k[i], self.v[i], tuple(lm[i] for lm in self.landmarks)

  def _kind(self):
    return selection.LandmarkKind(self.landmark_kind)

  def _set_landmarks(self, layer, phys, keys, num_valid):
    """Recompute the landmarks of pages `phys` from their keys `[*phys.shape, K, S, D]`.

    (`x.at[layer, :, phys]` puts the indexed axes first: numpy advanced-indexing order.)
    """
    if not self.landmarks:
      return self.landmarks
    num_valid = jnp.broadcast_to(num_valid, keys.shape[:-2])  # [*phys.shape, K]
    lm = selection.compute_landmarks(keys.astype(jnp.float32), num_valid, self._kind())
    lm = lm if isinstance(lm, tuple) else (lm,)
    return tuple(old.at[layer, :, phys].set(new) for old, new in zip(self.landmarks, lm))

  def assign_slots(self, slots, page_rows, lengths) -> "PagedKVCache":
    """Point `slots` at `page_rows` `[n, M]` and set their lengths (out-of-range slots drop)."""
    return self.replace(page_table=self.page_table.at[slots].set(page_rows, mode="drop"),
                        lengths=self.lengths.at[slots].set(lengths, mode="drop"))

  def write_prompt(self, layer: int, k, v, page_rows, lengths) -> "PagedKVCache":
    """Write whole prompts `k, v [n, T, K, D]` (T a multiple of S) at positions 0..T-1."""
    n, t, kh, d = k.shape
    s = self.page_size
    if t % s:
      raise ValueError(f"prompt block length {t} must be a multiple of page_size={s}")
    npg = t // s
    phys = page_rows[:, :npg]  # [n, npg]
    # [n, npg, K, S, D]: the order `x.at[layer, :, phys]` expects.
    kp = k.reshape(n, npg, s, kh, d).transpose(0, 1, 3, 2, 4).astype(self.k.dtype)
    vp = v.reshape(n, npg, s, kh, d).transpose(0, 1, 3, 2, 4).astype(self.v.dtype)
    new_k = self.k.at[layer, :, phys].set(kp)
    new_v = self.v.at[layer, :, phys].set(vp)
    num_valid = jnp.clip(lengths[:, None] - jnp.arange(npg)[None, :] * s, 0, s)  # [n, npg]
    lms = self._set_landmarks(layer, phys, kp, num_valid[:, :, None])
    return self.replace(k=new_k, v=new_v, landmarks=lms)

  def write_token(self, layer: int, k, v, active) -> "PagedKVCache":
    """Write one token per slot (`k, v [B, K, D]`) at position `lengths[b]`."""
    s = self.page_size
    pos = self.lengths
    m = self.page_table.shape[1]
    logical = jnp.minimum(pos // s, m - 1)
    phys = jnp.take_along_axis(self.page_table, logical[:, None], axis=1)[:, 0]
    phys = jnp.where(active, phys, NULL_PAGE)  # [B]
    off = pos % s
    new_k = self.k.at[layer, :, phys, off].set(k.astype(self.k.dtype))  # value [B, K, D]
    new_v = self.v.at[layer, :, phys, off].set(v.astype(self.v.dtype))
    out = self.replace(k=new_k, v=new_v)
    if self.landmarks:
      keys = new_k[layer, :, phys]  # [B, K, S, D]
      out = out.replace(landmarks=out._set_landmarks(layer, phys, keys, (off + 1)[:, None]))
    return out


class PageAllocator:
  """Host-side free list of physical pages (page 0, the null page, is never handed out)."""

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
    self.num_pages = num_pages
    # Pop from the end: low page ids are handed out first, freed pages are reused first.
    self._free = list(range(num_pages - 1, 0, -1))
    self.total_allocated = 0
    self.total_freed = 0
    self.high_water = 0

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.num_pages - 1 - len(self._free)

  def alloc(self, n: int) -> list[int]:
    if n > len(self._free):
      raise RuntimeError(
          f"KV cache out of pages: asked for {n}, {len(self._free)} free of "
          f"{self.num_pages - 1}; raise num_pages or lower the number of slots")
    pages = [self._free.pop() for _ in range(n)]
    self.total_allocated += n
    self.high_water = max(self.high_water, self.num_used)
    return pages

  def free(self, pages) -> None:
    for p in pages:
      if not 0 < p < self.num_pages:
        raise ValueError(f"free of invalid page id {p}")
    self._free.extend(reversed(list(pages)))
    self.total_freed += len(pages)


def pages_for(num_tokens: int, page_size: int) -> int:
  return -(-int(num_tokens) // page_size)


def page_table_row(pages, width: int) -> np.ndarray:
  row = np.zeros((width,), np.int32)
  row[:len(pages)] = pages
  return row
