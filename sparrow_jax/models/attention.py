"""Attention strategies (DESIGN.md §2): `Dense()` or `BlockSparse(...)`.

The strategy is a small frozen (hashable, static under jit) object; the per-row page budgets
are traced arrays passed beside it, so changing budgets never recompiles. The same selection
code (`pallas_kernels.selection`) serves incremental decode and the teacher-forced
whole-sequence forward, so logits of the latter at position t equal those of decode at step t.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import jax.numpy as jnp

from sparrow_jax import cpu_kernels
from sparrow_jax.pallas_kernels import (dispatch, landmarks, selection, teacher_forced,
                                        train_attention)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dense:
  """Full causal attention. `backend` picks the paged decode implementation (`dispatch`),
  `train_backend` the whole-sequence one (`train_attention`: auto / xla / cudnn)."""

  backend: str = "auto"
  train_backend: str = "auto"

  def __post_init__(self):
    dispatch.parse_backend(self.backend)  # validates the name
    train_attention.as_train_attention(self.train_backend)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSparse:
  """Sparrow block-sparse attention: top-k pages by landmark score plus reserved pages.

  `max_budget` is the static maximum of the traced per-row budgets (compiled shapes).
  `landmark_dtype`: "float32" or "bfloat16", the dtype the cache keeps landmarks in (and the
  teacher-forced forward rounds them to, so both select the same pages).
  `page_scorer`: how a decode step scores pages: "auto" (the Triton page-score kernel with
  the Triton backends, XLA otherwise: `dispatch.page_scorer`) or "xla"
  (always the XLA gather and scores; the GPU suite measures the two side by side).
  """

  max_budget: int
  page_size: int = 16
  landmark: str = "mean"
  reserved_bos: int = 1
  reserved_recent: int = 2
  dense_layers: tuple[int, ...] = (0, 1)
  backend: str = "auto"
  landmark_dtype: str = "float32"
  train_backend: str = "auto"  # the dense layers' whole-sequence attention
  query_chunk: int = 128  # teacher-forced query chunk = key block (speed knob)
  page_scorer: str = "auto"

  def __post_init__(self):
    if self.max_budget < 1:
      raise ValueError(f"BlockSparse.max_budget={self.max_budget}: expected >= 1")
    if self.page_size < 1 or self.page_size & (self.page_size - 1):
      raise ValueError(f"BlockSparse.page_size={self.page_size}: expected a power of two")
    if self.landmark not in ("mean", "quest"):
      raise ValueError(f"BlockSparse.landmark={self.landmark!r}: expected 'mean' or 'quest'")
    if self.reserved_bos < 0 or self.reserved_recent < 1:
      raise ValueError(
          f"BlockSparse reserved pages bos={self.reserved_bos} recent={self.reserved_recent}: "
          "expected bos >= 0 and recent >= 1 (the partial page is always attended)")
    object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
    dispatch.parse_backend(self.backend)  # validates the name
    if self.landmark_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"BlockSparse.landmark_dtype={self.landmark_dtype!r}: expected "
                       "'float32' or 'bfloat16'")
    train_attention.as_train_attention(self.train_backend)
    if self.page_scorer not in ("auto", "xla"):
      raise ValueError(f"BlockSparse.page_scorer={self.page_scorer!r}: expected 'auto' or "
                       "'xla'")

  @property
  def kind(self) -> landmarks.LandmarkKind:
    return landmarks.LandmarkKind(self.landmark)


AttentionSpec = Union[Dense, BlockSparse]


def is_sparse_layer(spec: AttentionSpec, layer: int) -> bool:
  return isinstance(spec, BlockSparse) and layer not in spec.dense_layers


def causal_attention(q, k, v, lengths, *, query_chunk: int = 128, backend: str = "auto"):
  """Dense causal GQA attention (flash attention: cuDNN on a GPU in bf16, else XLA query
  chunks over the keys up to each chunk; float32 softmax statistics). q `[B, T, N, H]`, k/v
  `[B, T, K, H]`, lengths `[B]` -> `[B, T, N, H]` (positions at or past `lengths` are zero).
  `backend`: a `train_attention.TrainAttention` value."""
  return train_attention.causal_attention(q, k, v, lengths=lengths, impl=backend,
                                          block=query_chunk)


def full_sequence_attention(spec: AttentionSpec, layer: int, q, k, v, *, lengths,
                            budgets=None, prompt_lengths=None, inference: bool = False,
                            cache_dtype=None):
  """Teacher-forced attention of one layer for whole sequences starting at position 0.

  `inference` (the engine's prefill, never differentiated): with `backend="cpu"` a dense
  layer runs the C++ causal kernel (`cpu_kernels.causal_attention`) where it takes the head
  dim, instead of the `train_backend` path; with a bfloat16 `cache_dtype` (the cache it is
  writing) it attends to K/V as the cache stores them, with the kernel's bf16 products."""
  if not is_sparse_layer(spec, layer):
    if (inference and dispatch.parse_backend(spec.backend) is dispatch.Backend.CPU
        and cpu_kernels.causal_attention_supported(q)):
      if cache_dtype is not None and jnp.dtype(cache_dtype) == jnp.bfloat16:
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
      return cpu_kernels.causal_attention(q, k, v, lengths)
    return causal_attention(q, k, v, lengths, backend=spec.train_backend)
  if budgets is None:
    raise ValueError("BlockSparse attention needs `budgets` [B, T] (pages per query position)")
  return teacher_forced.sparse_attention_teacher_forced(
      q, k, v, budgets, lengths=lengths, prompt_lengths=prompt_lengths, kind=spec.kind,
      max_budget=spec.max_budget, reserved_bos=spec.reserved_bos,
      reserved_recent=spec.reserved_recent, page_size=spec.page_size,
      query_chunk=spec.query_chunk, landmark_dtype=spec.landmark_dtype)


def decode_attention(spec: AttentionSpec, layer: int, q, cache, lengths, *, budgets=None):
  """Attention of one new token per slot (`q [B, N, H]`) against the paged cache."""
  k_pages, v_pages, lms = cache.layer(layer)
  if not is_sparse_layer(spec, layer):
    # The sequences' own pages only, in the cache dtype with float32 accumulation.
    return dispatch.dense_decode_attention(q, k_pages, v_pages, cache.page_table, lengths,
                                           backend=spec.backend)
  if budgets is None:
    raise ValueError("BlockSparse attention needs `budgets` [B] (pages per slot)")
  if cache.landmark_kind != spec.landmark:
    raise ValueError(f"cache keeps {cache.landmark_kind!r} landmarks but the attention spec "
                     f"asks for {spec.landmark!r}")
  cache_lm_dtype = lms[0].dtype if lms else None
  if cache_lm_dtype is not None and cache_lm_dtype != jnp.dtype(spec.landmark_dtype):
    raise ValueError(f"cache keeps {cache_lm_dtype} landmarks but the attention spec asks for "
                     f"landmark_dtype={spec.landmark_dtype!r}")
  if cache.page_size != spec.page_size:
    raise ValueError(f"cache page_size={cache.page_size} differs from the attention spec's "
                     f"page_size={spec.page_size}")
  backend = dispatch.resolve_backend(spec.backend)
  config = dispatch.default_config(backend, spec.page_size)  # None for XLA
  slot_multiple = 1 if config is None else config.slot_multiple()
  lm = lms[0] if spec.kind == landmarks.LandmarkKind.MEAN else lms
  page_idx, valid = selection.select_decode_pages(
      q, lm, cache.page_table, lengths, budgets, kind=spec.kind, max_budget=spec.max_budget,
      page_size=spec.page_size, reserved_bos=spec.reserved_bos,
      reserved_recent=spec.reserved_recent, slot_multiple=slot_multiple,
      scorer=dispatch.page_scorer(backend) if spec.page_scorer == "auto" else "xla")
  return dispatch.sparse_decode_attention(
      q, k_pages, v_pages, cache.page_table, lengths, page_idx, valid, backend=backend,
      config=config)
