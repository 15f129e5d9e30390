"""Paged KV cache: the device pytree the decoder reads and writes, and its memory formula.

Layout (DESIGN.md §3), one buffer per layer l (a tuple over layers, never one stacked array):
  k[l], v[l]:    [K, P, S, D]     one physical page = S contiguous tokens of one kv head
  landmarks[l]:  ()                no landmarks (dense attention only)
                 ([K, P, D],)      "mean": mean key of the page
                 ([K, P, D],) * 2  "quest": per-channel (min, max) of the page's keys
                                   (in `landmark_dtype`: float32, or bfloat16 to halve the
                                   bytes page selection gathers every layer and step)
  page_table:    [B, M] int32      logical page j of slot b -> physical page id
  lengths:       [B] int32         tokens held by slot b

Why per-layer buffers: a decode step writes one token into every layer and then reads pages of
that layer. With one stacked `[L, K, P, S, D]` array, XLA has to keep the pre-write value of the
whole stack alive for the per-layer reads (`k[l]` is a slice) and copies the stack once per
layer and step — a cost proportional to the *pool*, not to what attention reads. Separate
buffers are updated in place (scatter into a donated buffer) and read by gathers of only the
pages needed.

Landmarks are written when a page *fills* (the Sparrow release does the same), plus once for
every prompt page at prefill. A partial page's landmark is never read: selection always attends
the newest `reserved_recent >= 1` pages, the partial page included, and scores only older (full)
pages. So a decode step reads back one page per slot only on the step that completes it.

Physical page 0 is the *null page*: never handed out by the allocator. Page-table entries past a
sequence's pages point at it and are masked by `lengths`. Writes of inactive slots, and landmark
writes of pages that did not fill, use an out-of-range index with `mode="drop"`: nothing is
written anywhere.

With rollouts sharded over devices (`sparrow_jax.engine`), every device holds its own pool; the
arrays here are then the per-device blocks (`P` pages, `B` slots) inside `shard_map`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparrow_jax import cpu_kernels
from sparrow_jax.pallas_kernels import landmarks


NULL_PAGE = 0
LANDMARK_KINDS = ("none", "mean", "quest")
LANDMARK_DTYPES = ("float32", "bfloat16")
_NUM_LANDMARKS = {"none": 0, "mean": 1, "quest": 2}


@struct.dataclass
class PagedKVCache:
  k: tuple  # L x [K, P, S, D]
  v: tuple  # L x [K, P, S, D]
  landmarks: tuple  # L x (() | (mean,) | (min, max)); each [K, P, D] in landmark_dtype
  page_table: jax.Array  # [B, M] int32
  lengths: jax.Array  # [B] int32
  landmark_kind: str = struct.field(pytree_node=False, default="none")

  @classmethod
  def create(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
             num_pages: int, max_pages_per_seq: int, page_size: int = 16,
             dtype=jnp.float32, landmark: str = "none",
             landmark_dtype: str = "float32") -> "PagedKVCache":
    if landmark not in LANDMARK_KINDS:
      raise ValueError(f"landmark={landmark!r}: expected one of {LANDMARK_KINDS}")
    check_landmark_dtype(landmark_dtype)
    if page_size <= 0 or page_size & (page_size - 1):
      raise ValueError(f"page_size={page_size}: expected a positive power of two")
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    lm_shape = (num_kv_heads, num_pages, head_dim)
    n_lm = _NUM_LANDMARKS[landmark]
    return cls(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        landmarks=tuple(tuple(jnp.zeros(lm_shape, landmark_dtype) for _ in range(n_lm))
                        for _ in range(num_layers)),
        page_table=jnp.zeros((num_slots, max_pages_per_seq), jnp.int32),
        lengths=jnp.zeros((num_slots,), jnp.int32), landmark_kind=landmark)

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def page_size(self) -> int:
    return self.k[0].shape[2]

  @property
  def num_pages(self) -> int:
    return self.k[0].shape[1]

  @property
  def num_slots(self) -> int:
    return self.page_table.shape[0]

  def layer(self, i: int):
    """(k_pages, v_pages, landmarks) of layer i: `[K, P, S, D]` x2 and a tuple of `[K, P, D]`.
    The buffers themselves (no slicing)."""
    return self.k[i], self.v[i], self.landmarks[i]

  def _kind(self):
    return landmarks.LandmarkKind(self.landmark_kind)

  def _with_layer(self, i, k=None, v=None, lms=None) -> "PagedKVCache":
    rep = lambda t, x: t if x is None else t[:i] + (x,) + t[i + 1:]
    return self.replace(k=rep(self.k, k), v=rep(self.v, v), landmarks=rep(self.landmarks, lms))

  def assign_slots(self, slots, page_rows, lengths) -> "PagedKVCache":
    """Point `slots` at `page_rows` `[n, W]` and set their lengths (out-of-range slots drop).

    The page table keeps its width M: rows are cut or zero-padded (null page) to it. (The
    engine passes a fresh, bucketed page table to every decode chunk, so the one a prefill
    leaves behind only matters to direct callers.)"""
    m, w = self.page_table.shape[1], page_rows.shape[1]
    rows = page_rows[:, :m] if w >= m else jnp.pad(page_rows, ((0, 0), (0, m - w)))
    return self.replace(page_table=self.page_table.at[slots].set(rows, mode="drop"),
                        lengths=self.lengths.at[slots].set(lengths, mode="drop"))

  def write_prompt(self, layer: int, k, v, page_rows, lengths) -> "PagedKVCache":
    """Write whole prompts `k, v [n, T, K, D]` (T a multiple of S) at positions 0..T-1 and the
    landmarks of their pages. Rows of `page_rows` that point at the null page (padding rows)
    write nothing."""
    n, t, kh, d = k.shape
    s = self.page_size
    if t % s:
      raise ValueError(f"prompt block length {t} must be a multiple of page_size={s}")
    npg = t // s
    phys = page_rows[:, :npg]  # [n, npg]
    num_valid = jnp.clip(lengths[:, None] - jnp.arange(npg)[None, :] * s, 0, s)  # [n, npg]
    # Pages past a prompt's end (and padding rows) are the null page: drop their writes.
    dest = jnp.where((phys != NULL_PAGE) & (num_valid > 0), phys, self.num_pages)  # [n, npg]
    # `x.at[:, dest]` has shape [K, n, npg, S, D].
    kp = k.reshape(n, npg, s, kh, d).transpose(3, 0, 1, 2, 4)  # [K, n, npg, S, D]
    vp = v.reshape(n, npg, s, kh, d).transpose(3, 0, 1, 2, 4)
    new_k = _scatter_set(self.k[layer], (slice(None), dest), kp)
    new_v = _scatter_set(self.v[layer], (slice(None), dest), vp)
    lms = self.landmarks[layer]
    if lms:
      # Landmarks from the keys as stored (cache dtype), as decode would read them back,
      # rounded once to the landmark dtype.
      stored = kp.astype(self.k[layer].dtype)
      nv = jnp.broadcast_to(num_valid[None], stored.shape[:3])  # [K, n, npg]
      lm = landmarks.compute_landmarks(stored, nv, self._kind())
      lm = lm if isinstance(lm, tuple) else (lm,)
      lms = tuple(_scatter_set(old, (slice(None), dest), new) for old, new in zip(lms, lm))
    return self._with_layer(layer, new_k, new_v, lms)

  def write_token(self, layer: int, k, v, active, *, cpu_kernel: bool = False
                  ) -> "PagedKVCache":
    """Write one token per slot (`k, v [B, K, D]`) at position `lengths[b]`; inactive slots
    write nothing. When the token completes its page, that page's landmark is written.
    `cpu_kernel`: a 16-bit cache's write through `cpu_kernels.cache_write_token` (in place;
    XLA:CPU's scatter widens the whole buffer to float32 and back). The same values."""
    s = self.page_size
    pos = self.lengths  # [B]
    m = self.page_table.shape[1]
    logical = jnp.minimum(pos // s, m - 1)
    phys = jnp.take_along_axis(self.page_table, logical[:, None], axis=1)[:, 0]  # [B]
    off = pos % s
    oob = self.num_pages
    dest = jnp.where(active, phys, oob)  # [B]
    # `x.at[:, dest, off]` has shape [K, B, D].
    if cpu_kernel and self.k[layer].dtype.itemsize == 2:
      row = lambda x: jnp.swapaxes(x, 0, 1).astype(self.k[layer].dtype)
      new_k, new_v = cpu_kernels.cache_write_token(self.k[layer], self.v[layer], row(k),
                                                   row(v), dest, off)
    else:  # in place on GPU / TPU (XLA:CPU widens a bf16 one: the `cpu` backend avoids it)
      new_k = self.k[layer].at[:, dest, off].set(
          jnp.swapaxes(k, 0, 1).astype(self.k[layer].dtype), mode="drop")
      new_v = self.v[layer].at[:, dest, off].set(
          jnp.swapaxes(v, 0, 1).astype(self.v[layer].dtype), mode="drop")
    lms = self.landmarks[layer]
    if lms:
      filled = active & (off == s - 1)  # [B]
      keys = new_k[:, phys]  # [K, B, S, D]: one page per slot
      nv = jnp.full(keys.shape[:2], s, jnp.int32)  # [K, B]
      lm = landmarks.compute_landmarks(keys, nv, self._kind())
      lm = lm if isinstance(lm, tuple) else (lm,)
      lm_dest = jnp.where(filled, phys, oob)
      lms = tuple(old.at[:, lm_dest].set(new.astype(old.dtype), mode="drop")
                  for old, new in zip(lms, lm))
    return self._with_layer(layer, new_k, new_v, lms)


def _scatter_set(buf, index, new):
  """`buf.at[index].set(new, mode="drop")` in buf's dtype (the prompt's pages). On the CPU
  platform 16-bit float buffers are written through their bits (uint16): XLA:CPU widens a
  bfloat16 scatter to float32, converting the whole buffer there and back (a float32 copy of
  the layer's cache); as uint16 it costs one copy. The same values; other platforms scatter
  bf16 natively. (The decode step's one-token write stays a plain scatter, which XLA updates
  in place; the `cpu` backend writes it with `cpu_kernels.cache_write_token`.)"""
  new = new.astype(buf.dtype)
  if (jnp.issubdtype(buf.dtype, jnp.floating) and buf.dtype.itemsize == 2
      and jax.default_backend() == "cpu"):
    bits = jax.lax.bitcast_convert_type(buf, jnp.uint16).at[index].set(
        jax.lax.bitcast_convert_type(new, jnp.uint16), mode="drop")
    return jax.lax.bitcast_convert_type(bits, buf.dtype)
  return buf.at[index].set(new, mode="drop")


def check_landmark_dtype(landmark_dtype) -> None:
  if landmark_dtype not in LANDMARK_DTYPES:
    raise ValueError(f"landmark_dtype={landmark_dtype!r}: expected one of {LANDMARK_DTYPES}")


def kv_bytes_per_page(*, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                      dtype, landmark: str = "none", landmark_dtype: str = "float32") -> int:
  """Device bytes one physical page costs over all layers: K and V in the cache dtype plus the
  landmarks in their dtype. The engine sizes its pool with it and the memory planner uses the
  same formula."""
  if landmark not in LANDMARK_KINDS:
    raise ValueError(f"landmark={landmark!r}: expected one of {LANDMARK_KINDS}")
  check_landmark_dtype(landmark_dtype)
  item = np.dtype(jnp.dtype(dtype)).itemsize
  kv = 2 * num_kv_heads * page_size * head_dim * item
  lm_item = np.dtype(jnp.dtype(landmark_dtype)).itemsize
  lm = _NUM_LANDMARKS[landmark] * num_kv_heads * head_dim * lm_item
  return num_layers * (kv + lm)


def pages_for(num_tokens: int, page_size: int) -> int:
  return -(-int(num_tokens) // page_size)


def page_table_row(pages, width: int) -> np.ndarray:
  row = np.zeros((width,), np.int32)
  row[:len(pages)] = pages
  return row
