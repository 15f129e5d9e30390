"""The engine's jitted per-device programs: prefill and the chunked decode loop.

`DeviceSteps` is a base of `GenerationEngine` (which provides the graphdef, the configs, the
mesh, the attention strategy and schedule, and the cache specs): each body runs under
`shard_map`, one device's slots against that device's pool. One program is compiled per key
(attention strategy, schedule bins, pruning on/off, the call's largest top_k) and cached;
`num_compilations` counts traces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sparrow_jax.engine.pruning import empty_record, record_detection
from sparrow_jax.engine.sampling import sample_tokens, topk_logprobs
from sparrow_jax.models import attention as attn_lib
from sparrow_jax.models.decoder import rope_tables, sequence_rope_tables
from sparrow_jax.models.quality_head import quality_logits
from sparrow_jax.schedule.schedule import budget_pages, teacher_forced_budgets

AXIS = "rollout"  # the one mesh axis of the engine: every device is a shard
_sequence_rope = jax.jit(sequence_rope_tables, static_argnums=(0, 1, 2))


class DeviceSteps:
  """Prefill and decode bodies and their compiled-program caches (a base of the engine)."""

  def _prefill_local(self, attention, max_top_k, state, cache, tokens, lengths, slots,
                     page_rows, seeds, temps, top_ps, top_ks, table, prompt_lengths, lora,
                     rope, det=None, packed=None):
    """Prefill rows `[n, T]`, sample each one's next token. With `det` (pruning), also the
    detection record of each row's last context token: the one input token of a sequence
    that no decode step takes (for a readmitted sequence, its last generated token)."""
    model = nnx.merge(self.graphdef, state)
    n, t = tokens.shape
    budgets = None
    if isinstance(attention, attn_lib.BlockSparse):
      budgets = teacher_forced_budgets(self.schedule, t, n, table)
    cache, logits, hidden = model.prefill(cache, tokens, lengths, slots, page_rows,
                                          attention=attention, budgets=budgets,
                                          prompt_lengths=prompt_lengths, lora=lora,
                                          return_hidden=True,
                                          matmul_dtype=self._prefill_matmul_dtype(),
                                          packed=packed, rope=rope)
    tok, lp = sample_tokens(logits, seeds, lengths, temps, top_ps, top_ks,
                            max_top_k=max_top_k)
    tk = self._topk(logits, temps)
    rec = ()
    if det is not None:
      hidden = hidden.astype(jnp.float32)
      last = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]  # [n]
      valid = slots < self.config.num_slots  # padding rows have an out-of-range slot
      rec = record_detection(empty_record(n, hidden.shape[-1]), last, lengths - 1, valid,
                             hidden, quality_logits(det[0], hidden), det)
    return cache, tok, lp, tk, rec

  def _prefill_matmul_dtype(self):
    """bfloat16 rollout weights (`cpu_decode_weights="bfloat16"`): the prefill's projections
    in bf16 too (float32 accumulation), so that every rollout token comes from bf16 weights."""
    return jnp.bfloat16 if self.config.cpu_decode_weights == "bfloat16" else None

  def _prefill_packed(self) -> bool:
    """Whether the prefill runs its projections on the packed copy: bfloat16 ones only (the
    C++ bf16 GEMM runs at or above XLA's rate; XLA's float32 GEMM beats the packed float32
    kernel at prefill sizes)."""
    return self._packed is not None and self.config.cpu_decode_weights == "bfloat16"

  def _topk(self, logits, temps):
    k = self.config.logprobs_topk
    if k:
      return topk_logprobs(logits, k, temps)
    b = logits.shape[0]
    return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)

  def _decode_local(self, max_top_k, state, cache, tokens, active, remaining, stop_ids, seeds,
                    temps, top_ps, top_ks, table, lora, det=None, packed=None):
    """Up to `decode_chunk` steps. `det` (pruning) = (head_params, det_stop_ids [S],
    prompt_len [B], det_end [B]): records the hidden state and head logit at the last stop
    token in the detection window [prompt_len, det_end] and at the latest token in it.
    `packed`: the engine's `pack_decode_weights` copy (`EngineConfig.cpu_decode_weights`).
    Returns the final (token, active, remaining, tokens generated) too: the next chunk can
    start from them before the host has read this one."""
    model = nnx.merge(self.graphdef, state)
    c, b, k = self.config.decode_chunk, tokens.shape[0], self.config.logprobs_topk
    outs = (jnp.zeros((c, b), jnp.int32), jnp.zeros((c, b), jnp.float32),
            jnp.zeros((c, b, k), jnp.int32), jnp.zeros((c, b, k), jnp.float32))
    rec0 = empty_record(b, self.model_config.hidden_size) if det is not None else ()

    # RoPE tables of the whole chunk, computed once outside the loop: an active slot's step j
    # writes at position lengths + j (an inactive slot's outputs are discarded anyway).
    pos = cache.lengths[None, :] + jnp.arange(c, dtype=jnp.int32)[:, None]  # [C, B]
    mc = self.model_config
    cos_t, sin_t = rope_tables(pos, mc.head_dim, mc.rope_theta)  # [C, B, Dh] x2

    def cond(carry):
      step, active = carry[0], carry[3]
      return (step < c) & jnp.any(active)

    def body(carry):
      step, cache, tok, active, remaining, count, outs, rec = carry
      budgets = None
      if self.schedule is not None:
        budgets = budget_pages(self.schedule, cache.lengths + 1, table)
      pos = cache.lengths  # position of the input token
      rope = (jax.lax.dynamic_index_in_dim(cos_t, step, 0, keepdims=False),
              jax.lax.dynamic_index_in_dim(sin_t, step, 0, keepdims=False))
      cache, logits, hidden = model.decode(cache, tok, active, attention=self.attention,
                                           budgets=budgets, lora=lora, return_hidden=True,
                                           rope=rope, packed=packed)
      if det is not None:
        hidden = hidden.astype(jnp.float32)
        rec = record_detection(rec, tok, pos, active, hidden, quality_logits(det[0], hidden),
                               det)
      new_tok, lp = sample_tokens(logits, seeds, cache.lengths, temps, top_ps, top_ks,
                                  max_top_k=max_top_k)
      tk_ids, tk_lp = self._topk(logits, temps)
      row = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, step, 0)
      outs = tuple(row(o, x) for o, x in zip(outs, (new_tok, lp, tk_ids, tk_lp)))
      # Device-side finish: a stop id or the last allowed token ends the sequence now.
      remaining = remaining - active.astype(jnp.int32)
      count = count + active.astype(jnp.int32)
      done = jnp.any(new_tok[:, None] == stop_ids, axis=-1) | (remaining <= 0)
      new_tok = jnp.where(active, new_tok, tok)
      return step + 1, cache, new_tok, active & ~done, remaining, count, outs, rec

    init = (jnp.int32(0), cache, tokens, active, remaining, jnp.zeros_like(remaining), outs,
            rec0)
    steps, cache, tok, active, remaining, count, outs, rec = jax.lax.while_loop(cond, body,
                                                                                init)
    return cache, outs, steps[None], rec, (tok, active, remaining, count)

  def _append_local(self, max_top_k, state, cache, inputs, n_in, slots, seeds, temps, top_ps,
                    top_ks, table, lora, packed=None):
    """Append rows `[n, F]`: row r writes `inputs[r, :n_in[r]]` into slot `slots[r]`'s own
    pages at its positions `cache.lengths[slot]...` in one forward (`Decoder.extend`: each
    query attends exactly as the decode step at its position would, its budget by its
    position, landmarks as pages fill), then samples its next token from the logits of its
    last input at its new length, as decode does. Padding rows (out-of-range slot) write
    nothing."""
    model = nnx.merge(self.graphdef, state)
    n, f = inputs.shape
    mc = self.model_config
    safe = jnp.clip(slots, 0, self.config.num_slots - 1)
    pos = cache.lengths[safe][:, None] + jnp.arange(f, dtype=jnp.int32)[None, :]  # [n, F]
    rope = rope_tables(pos, mc.head_dim, mc.rope_theta)  # once, outside the layers
    budgets = None
    if self.schedule is not None:
      budgets = budget_pages(self.schedule, pos + 1, table)
    cache, last = model.extend(cache, inputs, n_in, slots, attention=self.attention,
                               budgets=budgets, lora=lora, rope=rope, packed=packed)
    tok, lp = sample_tokens(last, seeds, pos[:, 0] + n_in, temps, top_ps, top_ks,
                            max_top_k=max_top_k)
    return cache, tok, lp, self._topk(last, temps)

  def _get_append(self, max_top_k: int = 0):
    """The append program: args (state, cache, inputs [rows, F], n_in, slots, seeds, temps,
    top_ps, top_ks, table, lora[, packed])."""
    with_packed = self._packed is not None
    key = ("append", self.attention, None if self.schedule is None
           else (self.schedule.bin_size, self.schedule.num_bins), max_top_k, with_packed)
    if key not in self._decode_fn:
      def fn(state, cache, *args):
        self.num_compilations += 1
        rows = P(AXIS)
        in_specs = (P(), self._cache_specs(), rows, rows, rows, rows, rows, rows, rows, P(),
                    P())
        if with_packed:
          in_specs += (P(),)

        def local(st, ca, *a):
          a = list(a)
          packed = a.pop() if with_packed else None
          return self._append_local(max_top_k, st, ca, *a, packed=packed)
        out_specs = (self._cache_specs(), rows, rows, (rows, rows))
        return self._shard(local, in_specs, out_specs)(state, cache, *args)
      self._decode_fn[key] = jax.jit(fn, donate_argnums=(1,))
    return self._decode_fn[key]

  def prefill_rope(self, t: int):
    """(cos, sin) `[t, head_dim]` of positions 0..t-1, replicated on the engine's mesh: an
    input of the prefill program rather than computed in it (`sequence_rope_tables`), cached
    per padded length."""
    if t not in self._rope_cache:
      mc = self.model_config
      tables = _sequence_rope(t, mc.head_dim, mc.rope_theta)
      self._rope_cache[t] = jax.device_put(tables, NamedSharding(self.mesh, P()))
    return self._rope_cache[t]

  def _get_prefill(self, attention, max_top_k: int = 0, with_det: bool = False):
    """The prefill program: args (state, cache, tokens, lengths, slots, page_rows, seeds,
    temps, top_ps, top_ks, table, prompt_lengths, lora, rope[, det][, packed]): `rope` the
    (cos, sin) tables of the rows' positions (`prefill_rope`), `packed` when
    `_prefill_packed()`."""
    with_packed = self._prefill_packed()
    key = (attention, max_top_k, with_det, with_packed)
    if key not in self._prefill_fn:
      def fn(state, cache, *args):
        self.num_compilations += 1  # runs at trace time only

        def local(st, ca, *a):
          a = list(a)
          packed = a.pop() if with_packed else None
          return self._prefill_local(attention, max_top_k, st, ca, *a, packed=packed)
        rows = P(AXIS)
        in_specs = (P(), self._cache_specs(), rows, rows, rows, rows, rows, rows, rows, rows,
                    P(), rows, P(), P())
        rec_specs = ()
        if with_det:
          in_specs += ((P(), P(), rows, rows),)
          rec_specs = (rows,) * 6
        if with_packed:
          in_specs += (P(),)
        out_specs = (self._cache_specs(), rows, rows, (rows, rows), rec_specs)
        return self._shard(local, in_specs, out_specs)(state, cache, *args)
      self._prefill_fn[key] = jax.jit(fn, donate_argnums=(1,))
    return self._prefill_fn[key]

  def _get_decode(self, with_det: bool = False, max_top_k: int = 0):
    """The decode program: args (state, cache, tokens, active, remaining, stop_ids, seeds,
    temps, top_ps, top_ks, table, lora[, det][, packed]): `det` with pruning, `packed` when
    the engine keeps packed decode weights (`self._packed is not None`)."""
    with_packed = self._packed is not None
    key = (self.attention, None if self.schedule is None
           else (self.schedule.bin_size, self.schedule.num_bins), with_det, max_top_k,
           with_packed)
    if key not in self._decode_fn:
      def fn(state, cache, *args):
        self.num_compilations += 1
        rows = P(AXIS)
        cols = P(None, AXIS)
        in_specs = (P(), self._cache_specs(), rows, rows, rows, rows, rows, rows, rows, rows,
                    P(), P())
        rec_specs = ()
        if with_det:
          in_specs += ((P(), P(), rows, rows),)
          rec_specs = (rows,) * 6
        if with_packed:
          in_specs += (P(),)
        out_specs = (self._cache_specs(), (cols, cols, cols, cols), rows, rec_specs,
                     (rows,) * 4)

        def local(st, ca, *a):
          a = list(a)
          packed = a.pop() if with_packed else None
          det = a.pop() if with_det else None
          return self._decode_local(max_top_k, st, ca, *a, det=det, packed=packed)
        return self._shard(local, in_specs, out_specs)(state, cache, *args)
      self._decode_fn[key] = jax.jit(fn, donate_argnums=(1,))
    return self._decode_fn[key]
