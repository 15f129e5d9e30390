"""Qwen3-family decoder in Flax NNX (also Qwen2 and Llama through config flags).

One module serves three execution modes, all sharing the same projections, norms and RoPE:

* `__call__` / `forward`: teacher-forced whole sequence, causal. Attention is a strategy
  (`Dense()` or `BlockSparse(...)`, see `attention.py`); the block-sparse strategy selects pages
  for every query position exactly as incremental decode would at that step.
* `prefill`: a batch of prompts written into the paged KV cache (dense causal attention, as
  in SGLang/Vortex where only decode is sparse; a sequence readmitted after preemption
  recomputes its generated part with the decode-time sparse attention).
* `decode`: one token per sequence slot against the paged cache, dense or block-sparse.

Weights use einsum-friendly layouts whose names end in their axes:
`q_DNH [hidden, heads, head_dim]`, `k_DKH`, `v_DKH`, `o_NHD`, `gate_DF`, `up_DF`, `down_FD`,
`embed_VD`, `lm_head_DV`. `dtype` is the compute dtype, `param_dtype` the storage dtype; norms,
softmax and logits accumulate in float32.

An optional LoRA tree (`lora.py`) adds `scale * (x @ A) @ B` to any of the projections
q/k/v/o/gate/up/down. It is an argument, never a module attribute, so the dense policy's
parameter tree cannot contain it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sparrow_jax import cpu_kernels
from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.sharding_hints import constrain_batch
from sparrow_jax.models.config import ModelConfig
from sparrow_jax.models.kv_cache import PagedKVCache
from sparrow_jax.pallas_kernels import dispatch

_INIT_STD = 0.02


def _jdtype(name: str):
  return jnp.dtype(name)


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32, output cast back to the compute dtype (as HF does)."""

  def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
    return self.scale.value.astype(self.dtype) * y


def _normal(rngs, shape, param_dtype):
  return nnx.Param((_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32))
                   .astype(param_dtype))


def _mm(eq: str, x, w, dt, matmul_dtype=None):
  """One projection. `matmul_dtype` (e.g. bfloat16): operands rounded to it, products
  accumulated in float32, the result in the compute dtype `dt` (XLA:CPU's bf16 GEMM runs
  ~1.7x its float32 one only with a float32 output)."""
  if matmul_dtype is None:
    return jnp.einsum(eq, x, w.astype(dt))
  return jnp.einsum(eq, x.astype(matmul_dtype), w.astype(matmul_dtype),
                    preferred_element_type=jnp.float32).astype(dt)


def _apply_lora(y, x, lora_pair, eq_a: str, eq_b: str, dtype):
  """y + scale * (x @ A) @ B for one projection; `lora_pair` = {"a", "b", "scale"}."""
  if lora_pair is None:
    return y
  a = lora_pair["a"].astype(dtype)
  b = lora_pair["b"].astype(dtype)
  h = jnp.einsum(eq_a, x, a)
  return y + (lora_pair["scale"] * jnp.einsum(eq_b, h, b)).astype(y.dtype)


def rope_tables(positions, head_dim: int, theta: float):
  """cos/sin tables `[..., head_dim]` (float32) for integer positions, HF rotate-half layout."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def sequence_rope_tables(t: int, head_dim: int, theta: float):
  """cos/sin `[T, head_dim]` of positions 0..T-1, for a whole-sequence forward (rows start at
  position 0). In the same XLA program as the layers, XLA:CPU fuses cos/sin into every q and
  k rope and evaluates them per head and per layer (it drops optimization barriers before
  fusion): a 1K-token SmolLM2 prefill spent 2.3 ms per layer there. Callers that can pass
  them in as a program input (`Decoder.prefill(rope=)`, the engine) avoid that; inside a
  scan over layers they are a loop invariant, computed once."""
  return rope_tables(jnp.arange(t, dtype=jnp.int32), head_dim, theta)


def apply_rope(x, cos, sin):
  """x `[..., heads, Dh]`, cos/sin `[..., Dh]` broadcast over heads; float32 math."""
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  out = xf * cos[..., None, :] + rot * sin[..., None, :]
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """GQA attention projections with optional q/k RMSNorm (Qwen3) and q/k/v bias (Qwen2)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = _jdtype(cfg.param_dtype)
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.dtype = _jdtype(cfg.dtype)
    self.q_DNH = _normal(rngs, (d, n, h), pd)
    self.k_DKH = _normal(rngs, (d, k, h), pd)
    self.v_DKH = _normal(rngs, (d, k, h), pd)
    self.o_NHD = _normal(rngs, (n, h, d), pd)
    if cfg.attention_bias:
      self.q_bias_NH = nnx.Param(jnp.zeros((n, h), pd))
      self.k_bias_KH = nnx.Param(jnp.zeros((k, h), pd))
      self.v_bias_KH = nnx.Param(jnp.zeros((k, h), pd))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=self.dtype, param_dtype=pd)
      self.k_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=self.dtype, param_dtype=pd)

  def qkv(self, x, positions, lora=None, rope=None, packed=None, matmul_dtype=None):
    """x `[..., D]` -> q `[..., N, H]`, k, v `[..., K, H]` with norms and RoPE applied.
    `rope`: the (cos, sin) tables of `positions` when the caller computed them already.
    `packed`: this layer's `pack_decode_weights` entry (the C++ CPU matmul instead of XLA's).
    `matmul_dtype`: see `_mm`."""
    dt = self.dtype
    lora = lora or {}
    x = x.astype(dt)
    if packed is not None:  # q, k, v in one product (one kernel call)
      _, n, h = self.q_DNH.value.shape
      kv = self.k_DKH.value.shape[1]
      y = _packed(x, packed["qkv"], (n + 2 * kv) * h, dt)
      q = y[..., :n * h].reshape(*x.shape[:-1], n, h)
      k = y[..., n * h:(n + kv) * h].reshape(*x.shape[:-1], kv, h)
      v = y[..., (n + kv) * h:].reshape(*x.shape[:-1], kv, h)
    else:
      md = matmul_dtype
      q = _mm("...d,dnh->...nh", x, self.q_DNH.value, dt, md)
      k = _mm("...d,dkh->...kh", x, self.k_DKH.value, dt, md)
      v = _mm("...d,dkh->...kh", x, self.v_DKH.value, dt, md)
    q = _apply_lora(q, x, lora.get("q"), "...d,dr->...r", "...r,rnh->...nh", dt)
    k = _apply_lora(k, x, lora.get("k"), "...d,dr->...r", "...r,rkh->...kh", dt)
    v = _apply_lora(v, x, lora.get("v"), "...d,dr->...r", "...r,rkh->...kh", dt)
    if self.cfg.attention_bias:
      q = q + self.q_bias_NH.value.astype(dt)
      k = k + self.k_bias_KH.value.astype(dt)
      v = v + self.v_bias_KH.value.astype(dt)
    if self.cfg.qk_norm:
      q = self.q_norm(q)
      k = self.k_norm(k)
    cos, sin = rope if rope is not None else rope_tables(positions, self.cfg.head_dim,
                                                          self.cfg.rope_theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def out(self, o, lora=None, packed=None, matmul_dtype=None):
    """o `[..., N, H]` -> `[..., D]`."""
    dt = self.dtype
    n, h, d = self.o_NHD.value.shape
    # One contraction over the flattened (head, dim) axis, in the weight's own row-major
    # order: `einsum("...nh,nhd")` let XLA pick the order (h, n) and transpose the whole o
    # weight every call (a weight-sized copy per layer per decode step on CPU).
    o = o.astype(dt).reshape(*o.shape[:-2], n * h)
    if packed is not None:
      y = _packed(o, packed["o"], d, dt)
    else:
      y = _mm("...c,cd->...d", o, self.o_NHD.value.reshape(n * h, d), dt, matmul_dtype)
    lora_o = (lora or {}).get("o")
    if lora_o is not None:
      lora_o = dict(lora_o, a=lora_o["a"].reshape(n * h, -1))
    return _apply_lora(y, o, lora_o, "...c,cr->...r", "...r,rd->...d", dt)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = _jdtype(cfg.param_dtype)
    self.dtype = _jdtype(cfg.dtype)
    self.gate_DF = _normal(rngs, (cfg.hidden_size, cfg.intermediate_size), pd)
    self.up_DF = _normal(rngs, (cfg.hidden_size, cfg.intermediate_size), pd)
    self.down_FD = _normal(rngs, (cfg.intermediate_size, cfg.hidden_size), pd)

  def __call__(self, x, lora=None, packed=None, matmul_dtype=None):
    dt = self.dtype
    lora = lora or {}
    x = x.astype(dt)
    f = self.gate_DF.value.shape[1]
    if (packed is not None and lora.get("gate") is None and lora.get("up") is None
        and cpu_kernels.swiglu_supported(f)):
      # gate, up and the SwiGLU in one kernel call (the products stay in its tiles)
      h = cpu_kernels.packed_swiglu(x, packed["gate_up"], f).astype(dt)
    else:
      if packed is not None:  # gate and up in one product
        gu = _packed(x, packed["gate_up"], 2 * f, dt)
        g, u = gu[..., :f], gu[..., f:]
      else:
        g = _mm("...d,df->...f", x, self.gate_DF.value, dt, matmul_dtype)
        u = _mm("...d,df->...f", x, self.up_DF.value, dt, matmul_dtype)
      g = _apply_lora(g, x, lora.get("gate"), "...d,dr->...r", "...r,rf->...f", dt)
      u = _apply_lora(u, x, lora.get("up"), "...d,dr->...r", "...r,rf->...f", dt)
      h = jax.nn.silu(g) * u
    if packed is not None:
      y = _packed(h, packed["down"], self.down_FD.value.shape[1], dt)
    else:
      y = _mm("...f,fd->...d", h, self.down_FD.value, dt, matmul_dtype)
    return _apply_lora(y, h, lora.get("down"), "...f,fr->...r", "...r,rd->...d", dt)


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = _jdtype(cfg.param_dtype)
    dt = _jdtype(cfg.dtype)
    self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt, param_dtype=pd)
    self.attn = Attention(cfg, rngs=rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt,
                                  param_dtype=pd)
    self.mlp = MLP(cfg, rngs=rngs)


class Decoder(nnx.Module):
  """Decoder-only transformer; `model(tokens)` returns float32 logits `[B, T, V]`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    pd = _jdtype(cfg.param_dtype)
    self.cfg = cfg
    self.dtype = _jdtype(cfg.dtype)
    self.embed_VD = _normal(rngs, (cfg.vocab_size, cfg.hidden_size), pd)
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=self.dtype,
                              param_dtype=pd)
    if not cfg.tie_word_embeddings:
      self.lm_head_DV = _normal(rngs, (cfg.hidden_size, cfg.vocab_size), pd)

  # --- pieces ---------------------------------------------------------------------------
  def embed(self, tokens):
    return jnp.take(self.embed_VD.value, tokens, axis=0).astype(self.dtype)

  def logits(self, x):
    """Final norm + LM head, accumulated and returned in float32."""
    return self.lm_head(self.final_norm(x))

  def lm_head(self, xn, packed=None):
    """LM head on final-normed hidden states `[..., D]` -> float32 logits `[..., V]`."""
    if packed is not None:
      return cpu_kernels.packed_matmul(xn, packed, self.cfg.vocab_size)
    if self.cfg.tie_word_embeddings:
      w = self.embed_VD.value.astype(self.dtype)
      return jnp.einsum("...d,vd->...v", xn, w, preferred_element_type=jnp.float32)
    w = self.lm_head_DV.value.astype(self.dtype)
    return jnp.einsum("...d,dv->...v", xn, w, preferred_element_type=jnp.float32)

  def _layer_lora(self, lora, i):
    if lora is None:
      return None
    return lora["layers"][i]

  # --- teacher-forced whole sequence ----------------------------------------------------
  def hidden_states(self, tokens, *, lengths=None,
                    attention: attn_lib.AttentionSpec | None = None, budgets=None,
                    prompt_lengths=None, lora=None, remat: bool = False):
    """Residual stream after the last layer (before the final norm), `[B, T, D]`.

    Args:
      tokens: int32 `[B, T]`; each row starts at position 0.
      lengths: int32 `[B]` valid tokens per row (keys past it are masked); default T.
      attention: `Dense()` (default) or `BlockSparse(...)`.
      budgets: int32 `[B, T]` top-k page budget per query position (BlockSparse only).
      prompt_lengths: int32 `[B]`: queries before this position attend densely, as the
        dense prefill of the generation engine does (BlockSparse only; default 0).
      lora: optional LoRA tree (see `lora.py`).
      remat: recompute each layer in the backward pass (activation memory of one layer
        instead of all; training long sequences needs it).
    """
    attention = attention if attention is not None else attn_lib.Dense()
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if lengths is None:
      lengths = jnp.full((b,), t, jnp.int32)
    x = constrain_batch(self.embed(tokens))
    rope = sequence_rope_tables(t, self.cfg.head_dim, self.cfg.rope_theta)  # [T, Dh] x2
    for group in self._layer_groups(attention):

      def block(layer_state, x, ll, i=group[0], graphdef=nnx.graphdef(self.layers[group[0]])):
        layer = nnx.merge(graphdef, layer_state)
        h = layer.input_norm(x)
        q, k, v = layer.attn.qkv(h, positions, ll, rope=rope)
        o = attn_lib.full_sequence_attention(
            attention, i, q, k, v, lengths=lengths, budgets=budgets,
            prompt_lengths=prompt_lengths)
        x = constrain_batch(x + layer.attn.out(o, ll))
        return constrain_batch(x + layer.mlp(layer.post_attn_norm(x), ll))

      fn = jax.checkpoint(block) if remat else block
      if len(group) == 1:
        x = fn(nnx.state(self.layers[group[0]]), x, self._layer_lora(lora, group[0]))
        continue
      # A scan over the group's layers, weights stacked in the compute dtype (every layer
      # casts them to it anyway, so the values are the same). Under `remat` the backward
      # recomputes one layer per iteration and keeps only each layer's input: in an
      # unrolled loop XLA:CPU merges the recomputation with the forward (its optimization
      # barriers are gone by then) and keeps every layer's activations. It also compiles
      # one layer instead of all of them.
      stacked = jax.tree.map(lambda *a: jnp.stack([self._compute_cast(v) for v in a]),
                             *[nnx.state(self.layers[i]) for i in group])
      stacked_lora = None
      if lora is not None:
        stacked_lora = jax.tree.map(lambda *a: jnp.stack(a),
                                    *[self._layer_lora(lora, i) for i in group])
      x, _ = jax.lax.scan(lambda x, xs: (fn(xs[0], x, xs[1]), None), x,
                          (stacked, stacked_lora))
    return x

  def _compute_cast(self, w):
    return (w.astype(self.dtype) if jnp.issubdtype(w.dtype, jnp.floating)
            and w.dtype.itemsize > jnp.dtype(self.dtype).itemsize else w)

  def _layer_groups(self, attention) -> list[list[int]]:
    """Consecutive layers that attend alike (dense / block-sparse), scanned together."""
    groups: list[list[int]] = []
    for i in range(self.cfg.num_layers):
      sparse = attn_lib.is_sparse_layer(attention, i)
      if groups and attn_lib.is_sparse_layer(attention, groups[-1][0]) == sparse:
        groups[-1].append(i)
      else:
        groups.append([i])
    return groups

  def __call__(self, tokens, **kw):
    """Causal forward of whole sequences: float32 logits `[B, T, V]`.

    Takes the keyword arguments of `hidden_states`. For long sequences and large vocabularies
    prefer `sparrow_jax.rl.logprobs.token_logprobs`, which never materialises `[B, T, V]`.
    """
    return self.logits(self.hidden_states(tokens, **kw))

  # --- paged cache: prefill -------------------------------------------------------------
  def prefill(self, cache: PagedKVCache, tokens, lengths, slots, page_rows, *,
              attention: attn_lib.AttentionSpec | None = None, budgets=None,
              prompt_lengths=None, lora=None, return_hidden: bool = False,
              matmul_dtype=None, packed=None, rope=None):
    """Write whole sequences into the cache and return the logits of each one's last token.

    Fresh prompts are prefilled with dense attention (as in SGLang/Vortex, only decode is
    sparse). A sequence *readmitted* after preemption holds prompt + generated tokens: with a
    block-sparse `attention`, queries at or past `prompt_lengths` attend exactly as decode did
    (the teacher-forced sparse path), so the recomputed cache and next-token logits are those
    an uninterrupted decode would have.

    Args:
      cache: the paged cache (all slots).
      tokens: int32 `[n, T]` sequences, right-padded; T a multiple of the page size.
      lengths: int32 `[n]` sequence lengths (>= 1).
      slots: int32 `[n]` destination slot of each row; an out-of-range slot (padding row)
        is dropped.
      page_rows: int32 `[n, M]` the page-table rows of those slots (physical page ids;
        unused entries 0, the null page).
      attention: `Dense()` (default) or `BlockSparse(...)`.
      budgets: int32 `[n, T]` page budgets per query position (BlockSparse only).
      prompt_lengths: int32 `[n]`; queries before it attend densely (BlockSparse only;
        default `lengths`, i.e. all dense).
      return_hidden: also return the final-normed hidden state of the last token `[n, D]`.
      matmul_dtype: the layers' projections with operands in this dtype and float32
        accumulation (`_mm`; the engine's bf16 rollout weights). The LM head stays as is.
      packed: `pack_decode_weights(model, bfloat16)`: every projection and the LM head through
        the C++ CPU kernel's bf16 GEMM on these copies (the same products as `matmul_dtype`
        bfloat16; the CPU platform only).
      rope: optional (cos, sin) `[T, head_dim]` of positions 0..T-1 (`sequence_rope_tables`),
        passed in as a program input (see there); computed here otherwise.
    Returns:
      (cache, logits float32 `[n, V]`) or (cache, logits, hidden) with `return_hidden`.
    """
    attention = attention if attention is not None else attn_lib.Dense()
    n, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    if isinstance(attention, attn_lib.BlockSparse) and prompt_lengths is None:
      prompt_lengths = lengths
    cache = cache.assign_slots(slots, page_rows, lengths)
    x = self.embed(tokens)
    md = matmul_dtype
    if rope is None:
      rope = sequence_rope_tables(t, self.cfg.head_dim, self.cfg.rope_theta)  # [T, Dh] x2
    for i, layer in enumerate(self.layers):
      ll = self._layer_lora(lora, i)
      pl = None if packed is None else packed["layers"][i]
      h = layer.input_norm(x)
      q, k, v = layer.attn.qkv(h, positions, ll, rope=rope, packed=pl, matmul_dtype=md)
      cache = cache.write_prompt(i, k, v, page_rows, lengths)
      o = attn_lib.full_sequence_attention(attention, i, q, k, v, lengths=lengths,
                                           budgets=budgets, prompt_lengths=prompt_lengths,
                                           inference=True, cache_dtype=cache.k[i].dtype)
      x = x + layer.attn.out(o, ll, packed=pl, matmul_dtype=md)
      x = x + layer.mlp(layer.post_attn_norm(x), ll, packed=pl, matmul_dtype=md)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [n, D]
    xn = self.final_norm(last)
    logits = self.lm_head(xn, packed=None if packed is None else packed["lm_head"])
    if return_hidden:
      return cache, logits, xn
    return cache, logits

  # --- paged cache: one decode step -----------------------------------------------------
  def decode(self, cache: PagedKVCache, tokens, active, *,
             attention: attn_lib.AttentionSpec | None = None, budgets=None, lora=None,
             return_hidden: bool = False, rope=None, packed=None):
    """Append one token per slot and return its logits.

    Args:
      cache: paged cache; `cache.lengths[b]` is the position of the new token of slot b.
      tokens: int32 `[B]` the tokens to append.
      active: bool `[B]`; inactive slots write nothing and keep their length.
      attention: `Dense()` or `BlockSparse(...)`.
      budgets: int32 `[B]` top-k page budget of each slot at this step (BlockSparse only).
      return_hidden: also return the final-normed hidden state `[B, D]` (quality heads).
      rope: optional precomputed (cos, sin) `[B, Dh]` of the positions `cache.lengths` (the
        engine computes a whole chunk's once, outside its decode loop: XLA:CPU would otherwise
        fuse the cos/sin into the per-page scoring of block-sparse layers and re-evaluate them
        for every page).
      packed: `pack_decode_weights(model, dtype)`: every projection and the LM head through
        the C++ CPU matmul on these packed copies (the CPU platform only).
    Returns:
      (cache with lengths advanced for active slots, float32 logits `[B, V]`), plus the
      hidden state with `return_hidden`.
    """
    attention = attention if attention is not None else attn_lib.Dense()
    positions = cache.lengths  # [B]
    x = self.embed(tokens)  # [B, D]
    new_lengths = positions + active.astype(jnp.int32)
    if rope is None:  # one (cos, sin) table per step, shared by every layer
      rope = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)  # [B, Dh] x2
    cpu_write = dispatch.parse_backend(attention.backend) is dispatch.Backend.CPU
    for i, layer in enumerate(self.layers):
      ll = self._layer_lora(lora, i)
      pl = None if packed is None else packed["layers"][i]
      h = layer.input_norm(x)
      q, k, v = layer.attn.qkv(h, positions, ll, rope=rope, packed=pl)  # [B,N,H], [B,K,H]
      cache = cache.write_token(i, k, v, active, cpu_kernel=cpu_write)
      o = attn_lib.decode_attention(attention, i, q, cache, new_lengths, budgets=budgets)
      x = x + layer.attn.out(o, ll, packed=pl)
      x = x + layer.mlp(layer.post_attn_norm(x), ll, packed=pl)
    cache = cache.replace(lengths=new_lengths)
    xn = self.final_norm(x)
    logits = self.lm_head(xn, packed=None if packed is None else packed["lm_head"])
    if return_hidden:
      return cache, logits, xn
    return cache, logits

  # --- paged cache: extend (a chunk of tokens at the sequences' ends) --------------------
  def extend(self, cache: PagedKVCache, tokens, n_in, slots, *,
             attention: attn_lib.AttentionSpec | None = None, budgets=None, lora=None,
             rope=None, packed=None):
    """Append up to F tokens per sequence in one forward (a chunked prefill at an offset):
    row r writes `tokens[r, :n_in[r]]` into slot `slots[r]`'s own pages at positions
    `cache.lengths[slot] ...` and attends to everything the slot holds before them plus the
    chunk's earlier tokens. The history is not recomputed: it is read from the pages.

    Every query attends exactly as the decode step at its position would (`decode` fed the
    same tokens one at a time): the chunk's keys and values (and the landmarks of the pages
    it completes) are written first, then each query runs the decode attention of one token
    with the cache holding `position + 1` tokens. Keys past a query's position are outside
    its length, a page completed later in the chunk is outside its pages, and the partial
    page, whose landmark is not final, is always a reserved page, never scored; so a
    block-sparse query selects the pages decode would. The projections and the MLP run on
    all `n x F` tokens as one batch; the attention reads each query's pages (the decode
    kernels, one query per row), F x the reads of one decode step.

    Args:
      cache: the paged cache (all slots), with `page_table` holding the rows' pages for
        every position they write (the engine grants them before the call).
      tokens: int32 `[n, F]`; entries at or past `n_in` are ignored.
      n_in: int32 `[n]` tokens of each row (0: the row writes nothing).
      slots: int32 `[n]` the slot of each row; an out-of-range slot (padding row) writes
        nothing.
      attention: `Dense()` (default) or `BlockSparse(...)`.
      budgets: int32 `[n, F]` page budget of each query (`budget_pages` at position + 1;
        BlockSparse only).
      rope: optional (cos, sin) `[n, F, Dh]` of the rows' positions.
      packed: as `decode`.
    Returns:
      (cache with the rows' lengths advanced by `n_in`, float32 logits `[n, V]` of each
      row's last token (row of `n_in` 0: meaningless)).
    """
    attention = attention if attention is not None else attn_lib.Dense()
    n, f = tokens.shape
    b = cache.lengths.shape[0]
    valid = (slots >= 0) & (slots < b)
    n_in = jnp.where(valid, n_in, 0)
    safe = jnp.where(valid, slots, 0)
    start = cache.lengths[safe]  # [n]
    positions = start[:, None] + jnp.arange(f, dtype=jnp.int32)[None, :]  # [n, F]
    active = jnp.arange(f, dtype=jnp.int32)[None, :] < n_in[:, None]  # [n, F]
    if rope is None:
      rope = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
    rope = tuple(r.reshape(n * f, -1) for r in rope)
    # One row per query: the slot's page row, its position as the cache length.
    table, lengths = cache.page_table, cache.lengths
    q_table = jnp.repeat(table[safe], f, axis=0)  # [n*F, M]
    q_pos = positions.reshape(n * f)
    q_active = active.reshape(n * f)
    q_len = jnp.where(q_active, q_pos + 1, 0)  # 0 = an empty row (output 0)
    q_budgets = None if budgets is None else budgets.reshape(n * f)
    view = cache.replace(page_table=q_table, lengths=q_pos)
    x = self.embed(tokens.reshape(n * f))  # [n*F, D]
    cpu_write = dispatch.parse_backend(attention.backend) is dispatch.Backend.CPU
    for i, layer in enumerate(self.layers):
      ll = self._layer_lora(lora, i)
      pl = None if packed is None else packed["layers"][i]
      h = layer.input_norm(x)
      q, k, v = layer.attn.qkv(h, q_pos, ll, rope=rope, packed=pl)
      view = view.write_token(i, k, v, q_active, cpu_kernel=cpu_write)
      o = attn_lib.decode_attention(attention, i, q, view, q_len, budgets=q_budgets)
      x = x + layer.attn.out(o, ll, packed=pl)
      x = x + layer.mlp(layer.post_attn_norm(x), ll, packed=pl)
    last = jnp.take_along_axis(x.reshape(n, f, -1),
                               jnp.maximum(n_in - 1, 0)[:, None, None], axis=1)[:, 0]
    cache = view.replace(page_table=table,
                         lengths=lengths.at[jnp.where(valid, slots, b)].add(n_in, mode="drop"))
    xn = self.final_norm(last)
    logits = self.lm_head(xn, packed=None if packed is None else packed["lm_head"])
    return cache, logits


def _packed(x, w_packed, n: int, dt):
  return cpu_kernels.packed_matmul(x, w_packed, n).astype(dt)


def pack_decode_weights(model: Decoder, dtype) -> dict:
  """Every projection and the LM head of `model` as `cpu_kernels.pack_weight` panels in
  `dtype` (float32 or bfloat16), for `Decoder.decode(packed=...)` / `prefill(packed=...)` on
  the CPU: {"layers": [{qkv, o, gate_up, down}], "lm_head"}, q|k|v and gate|up concatenated
  along their outputs (one kernel call each). A copy beside the parameters (training keeps
  using those), made again whenever the parameters change."""
  pack = lambda w: cpu_kernels.pack_weight(w, dtype)
  layers = []
  for layer in model.layers:
    a, m = layer.attn, layer.mlp
    d = a.q_DNH.value.shape[0]
    qkv = jnp.concatenate([a.q_DNH.value.reshape(d, -1), a.k_DKH.value.reshape(d, -1),
                           a.v_DKH.value.reshape(d, -1)], axis=1)
    layers.append({
        "qkv": pack(qkv), "o": pack(a.o_NHD.value.reshape(-1, a.o_NHD.value.shape[-1])),
        "gate_up": pack(jnp.concatenate([m.gate_DF.value, m.up_DF.value], axis=1)),
        "down": pack(m.down_FD.value)})
  head = (model.embed_VD.value.T if model.cfg.tie_word_embeddings
          else model.lm_head_DV.value)
  return {"layers": layers, "lm_head": pack(head)}


def init_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
  """A randomly initialised decoder."""
  return Decoder(cfg, rngs=nnx.Rngs(seed))


def param_count(model: Decoder) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# --- pure functional entry points (jitted steps take graphdef + state) ---------------------

def forward(graphdef, state, tokens, **kw) -> Any:
  """Pure-pytree form of `Decoder.__call__` for use inside jitted steps."""
  model = nnx.merge(graphdef, state)
  return model(tokens, **kw)
