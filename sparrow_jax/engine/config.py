"""The engine's configuration and its request / completion types.

`EngineConfig` is the static shape of a `GenerationEngine` (slots, context, page size, pool
size, decode chunk, admission watermark, ...); `resolve_pool_pages` turns its pool setting into
pages; `Request` and `Completion` are what `generate` takes and returns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np

from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.kv_cache import pages_for


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Static shape of the engine. Slot and pool sizes are per device (shard)."""

  num_slots: int = 8  # concurrent sequences per device
  max_seq_len: int = 2048  # prompt + generated tokens of one sequence
  page_size: int = 16
  num_pages: int | None = None  # pool pages per device incl. the null page
  kv_cache_bytes: int | None = None  # pool bytes per device (K, V, landmarks)
  kv_cache_memory_fraction: float | None = None  # of the device's free memory (GPU)
  decode_chunk: int = 16  # decode steps per jitted call
  cache_dtype: str | None = None  # default: the model's compute dtype
  # keep the top-k log-probs of every generated token (monitor), under softmax(logits / T) at
  # the request's temperature T (T = 1 when greedy), before its top-k / top-p filter
  logprobs_topk: int = 0
  min_page_bucket: int = 8  # smallest compiled page-table width (pages)
  page_buckets_per_octave: int = 4  # compiled widths per doubling (1: powers of two)
  # Admission keeps this fraction of a shard's pool free for the running sequences to grow
  # into (vLLM's watermark, 0.01 there too); a shard with nothing running ignores it.
  admission_watermark: float = 0.01
  # Dispatch the next decode chunk before reading the previous one back when the scheduler
  # allows (nothing queued, pages for two chunks): the host work overlaps the device's.
  overlap_chunks: bool = True
  # Tokens one prefill call may process per device (rows x padded length; vLLM's
  # max_num_batched_tokens): admitted prompts beyond it are prefilled in further calls, so
  # the prefill's activations stay bounded. 0: every admitted prompt in one call. One row
  # always fits (a long readmission is never refused).
  max_prefill_tokens: int = 0
  # CPU only: the decode step's projections and LM head through the C++ matmul
  # (`sparrow_jax.cpu_kernels`) on a packed copy of the weights in this dtype ("float32":
  # the same products; "bfloat16": half the bytes per step, rounded weights, and the
  # prefill's projections then run bf16 x bf16 with float32 accumulation, so every rollout
  # token comes from the bf16 weights). None: XLA's products on the parameters.
  cpu_decode_weights: str | None = None

  def __post_init__(self):
    for f in ("num_slots", "max_seq_len", "page_size", "decode_chunk", "min_page_bucket",
              "page_buckets_per_octave"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"EngineConfig.{f}={v!r}: expected an int >= 1")
    if self.page_size & (self.page_size - 1):
      raise ValueError(f"EngineConfig.page_size={self.page_size}: expected a power of two")
    given = [f for f in ("num_pages", "kv_cache_bytes", "kv_cache_memory_fraction")
             if getattr(self, f) is not None]
    if len(given) > 1:
      raise ValueError(f"EngineConfig: {' and '.join(given)} both size the KV pool; give one")
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError(f"EngineConfig.num_pages={self.num_pages}: expected >= 2 (page 0 is "
                       "the null page)")
    if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
      raise ValueError(f"EngineConfig.kv_cache_bytes={self.kv_cache_bytes}: expected > 0")
    f = self.kv_cache_memory_fraction
    if f is not None and not 0 < f <= 1:
      raise ValueError(f"EngineConfig.kv_cache_memory_fraction={f}: expected in (0, 1]")
    if (not isinstance(self.max_prefill_tokens, int) or isinstance(self.max_prefill_tokens, bool)
        or self.max_prefill_tokens < 0):
      raise ValueError(f"EngineConfig.max_prefill_tokens={self.max_prefill_tokens!r}: expected "
                       "an int >= 0 (0 = no limit)")
    if self.cpu_decode_weights not in (None, "float32", "bfloat16"):
      raise ValueError(f"EngineConfig.cpu_decode_weights={self.cpu_decode_weights!r}: expected "
                       "None, 'float32' or 'bfloat16'")
    if self.logprobs_topk < 0:
      raise ValueError(f"EngineConfig.logprobs_topk={self.logprobs_topk}: expected >= 0")
    if not 0 <= self.admission_watermark < 1:
      raise ValueError(f"EngineConfig.admission_watermark={self.admission_watermark}: "
                       "expected a fraction of the pool in [0, 1)")

  @property
  def max_pages_per_seq(self) -> int:
    return pages_for(self.max_seq_len, self.page_size)

  @property
  def worst_case_pages(self) -> int:
    """Pool pages for every slot at `max_seq_len` (+ the null page), plus the pages admission
    keeps free while something runs (`admission_watermark` of the pool), so that every slot
    is admitted even when each sequence starts near `max_seq_len`."""
    need = self.num_slots * self.max_pages_per_seq  # excludes the null page
    w = self.admission_watermark
    # Admission keeps int(w * (pool - 1)) pages free: extra >= w * (need + extra).
    extra = math.ceil(w * need / (1 - w)) if w else 0
    while extra < int(w * (need + extra)):  # float rounding
      extra += 1
    return need + extra + 1


def resolve_pool_pages(config: EngineConfig, bytes_per_page: int, device=None) -> int:
  """Pages of one device's pool (null page included) for `config`."""
  if config.num_pages is not None:
    return config.num_pages
  if config.kv_cache_bytes is not None:
    budget = config.kv_cache_bytes
    what = f"kv_cache_bytes={config.kv_cache_bytes}"
  elif config.kv_cache_memory_fraction is not None:
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
      raise ValueError(
          f"EngineConfig.kv_cache_memory_fraction={config.kv_cache_memory_fraction}: device "
          f"{device} does not report its memory; give kv_cache_bytes or num_pages instead")
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    budget = int(config.kv_cache_memory_fraction * free)
    what = (f"kv_cache_memory_fraction={config.kv_cache_memory_fraction} of "
            f"{free / 1e9:.2f} GB free")
  else:
    return config.worst_case_pages
  pages = budget // bytes_per_page
  if pages < 2:
    raise ValueError(f"EngineConfig {what}: {budget} bytes hold {pages} page(s) of "
                     f"{bytes_per_page} bytes; need at least 2 (the null page and one more)")
  return int(pages)


@dataclasses.dataclass
class Request:
  prompt_ids: Sequence[int]
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  request_id: Any = None
  group: Any = None  # prompt group (GRPO): pruning decides per group
  # Tokens after the prompt the sequence already holds (a multi-turn continuation: earlier
  # policy turns and the environment's tokens). They are prefilled as a readmission after
  # preemption is (block-sparse attention beyond the prompt, like decode), count against
  # max_new_tokens, and lead the completion's token_ids with log-prob 0; generation goes on
  # after them.
  context_ids: Sequence[int] = ()
  # Stop ids on which the sequence *pauses* instead of finishing (a tool-call boundary): it
  # keeps its slot and KV pages until `EngineSession.resume` appends the environment's tokens
  # (prefilled into its own pages; the history is not recomputed) or `EngineSession.finish`
  # ends it. Only a rollout session takes them (`GenerationEngine.generate` refuses them).
  pause_token_ids: Sequence[int] = ()


@dataclasses.dataclass
class Completion:
  """One finished sequence. `finish_reason` is 'stop' (EOS/stop id, included in
  `token_ids`), 'length' (max_new_tokens), 'context' (max_seq_len reached) or 'pruned'
  (removed by the prune hook while running; `pruned` is also set for a sequence that finished
  after L_detect but before its group was decided). A session reports a sequence that paused
  on one of its `pause_token_ids` as a Completion with 'paused' (`EngineSession.collect_paused`)."""

  request_id: Any
  prompt_ids: np.ndarray  # [P] int32
  token_ids: np.ndarray  # [n] int32
  logprobs: np.ndarray  # [n] float32, under the sampling distribution
  finish_reason: str
  topk_ids: np.ndarray | None = None  # [n, k] int32
  topk_logprobs: np.ndarray | None = None  # [n, k] float32, at the sampling temperature
  preemptions: int = 0  # times the sequence was preempted and recomputed
  pruned: bool = False  # removed by the prune hook (tokens are those generated until then)
  quality_logit: float | None = None  # head logit at the detection point (prune hook)
  detect_hidden: np.ndarray | None = None  # [D] final-normed hidden state there
  detect_index: int = -1  # generated-token index of that point (-1: none)
  # The policy version that sampled each token [n] int32 (None: one version for the whole
  # sequence, stamped by the producer) and which tokens the policy generated [n] (1) or an
  # environment appended (0); None = every token is the policy's.
  versions: np.ndarray | None = None
  loss_mask: np.ndarray | None = None
