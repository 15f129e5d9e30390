"""A tiny engine rollout through each Pallas backend in interpret mode gives the greedy tokens
of the XLA path: layer 0 dense, layer 1 block-sparse (1 top-k page + bos + 2 recent), all
inside the engine's jitted, shard_mapped decode loop.

- Triton (`pallas_interpret`) at the `tiny` preset's 2-token pages: the sparse kernel's default
  of 4 pages per block would hold 8 key rows there, fewer than a Triton dot takes, so the
  kernel and the selection padding must both take the page-size-aware default (8 pages per
  block). On an H200 the `tiny` main job failed here before (BENCHMARKS.md, GPU suite).
- TPU (`pallas_tpu_interpret`), bf16 cache: block-sparse layers run
  `tpu_decode.sparse_decode_tpu`, the dense layer jax's `ops.tpu.paged_attention`.
"""

import numpy as np
import pytest

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.pallas_kernels import dispatch, split_k
from sparrow_jax.pallas_kernels.paged_decode import PagedDecodeConfig
from sparrow_jax.pallas_kernels.sparse_decode import SparseDecodeConfig


def _rollouts(backends, *, page_size, max_new, max_seq_len, chunk, cache_dtype=None):
  """Greedy tokens and stats of the same requests through an engine on each backend."""
  model = init_model(get_config("tiny", eos_token_ids=()), seed=3)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 500, n)) for n in (5, 19, 30)]
  sp = SamplingParams(temperature=0.0, max_new_tokens=max_new)
  tokens, stats = {}, {}
  for backend in backends:
    att = BlockSparse(max_budget=1, page_size=page_size, dense_layers=(0,), backend=backend)
    eng = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=max_seq_len,
                                               page_size=page_size, decode_chunk=chunk,
                                               cache_dtype=cache_dtype),
                           attention=att)
    outs = eng.generate([Request(p, sp, i) for i, p in enumerate(prompts)])
    tokens[backend] = [list(o.token_ids) for o in outs]
    stats[backend] = eng.last_stats
  assert all(len(t) == max_new for t in tokens["xla"])
  return tokens, stats


def test_default_launch_config_follows_the_page_size():
  for page, ppb in ((1, 16), (2, 8), (4, 4), (16, 4), (64, 4)):
    cfg = dispatch.default_config(dispatch.Backend.PALLAS_INTERPRET, page)
    assert cfg == SparseDecodeConfig(pages_per_block=ppb), page
    assert cfg.slot_multiple() == ppb
  assert split_k.default_config(PagedDecodeConfig, 1).pages_per_block == 16
  assert split_k.default_config(PagedDecodeConfig, 16) == PagedDecodeConfig()


def test_rollout_with_triton_interpret_at_two_token_pages_equals_xla():
  tokens, stats = _rollouts(("xla", "pallas_interpret"), page_size=2, max_new=6,
                            max_seq_len=40, chunk=3)
  assert tokens["pallas_interpret"] == tokens["xla"]
  assert stats["pallas_interpret"]["decode_steps"] == stats["xla"]["decode_steps"]


@pytest.mark.slow  # 10-80 s by machine: the TPU interpreter traces every layer's kernel
def test_rollout_with_pallas_tpu_interpret_equals_xla():
  tokens, stats = _rollouts(("xla", "pallas_tpu_interpret"), page_size=4, max_new=8,
                            max_seq_len=48, chunk=4, cache_dtype="bfloat16")
  assert tokens["pallas_tpu_interpret"] == tokens["xla"]
  assert stats["pallas_tpu_interpret"]["decode_steps"] == stats["xla"]["decode_steps"]
