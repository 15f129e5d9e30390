"""A tiny engine rollout through the Triton kernels in Pallas interpret mode, at the `tiny`
preset's 2-token pages, gives the greedy tokens of the XLA path. The default sparse launch
config (4 pages per block) holds 8 key rows at that page size, fewer than a Triton dot takes:
the kernel and the selection padding must both take the page-size-aware default (8 pages per
block). On the H200 the `tiny` main job failed here before (BENCHMARKS.md, GPU suite)."""

import numpy as np

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.pallas_kernels import dispatch
from sparrow_jax.pallas_kernels.paged_decode import PagedDecodeConfig
from sparrow_jax.pallas_kernels.sparse_decode import SparseDecodeConfig
from sparrow_jax.pallas_kernels import split_k


def test_default_launch_config_follows_the_page_size():
  for page, ppb in ((1, 16), (2, 8), (4, 4), (16, 4), (64, 4)):
    cfg = dispatch.default_config(dispatch.Backend.PALLAS_INTERPRET, page)
    assert cfg == SparseDecodeConfig(pages_per_block=ppb), page
    assert cfg.slot_multiple() == ppb
  assert split_k.default_config(PagedDecodeConfig, 1).pages_per_block == 16
  assert split_k.default_config(PagedDecodeConfig, 16) == PagedDecodeConfig()


def test_rollout_with_triton_interpret_at_two_token_pages_equals_xla():
  model = init_model(get_config("tiny", eos_token_ids=()), seed=3)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 500, n)) for n in (5, 19, 30)]
  sp = SamplingParams(temperature=0.0, max_new_tokens=6)
  tokens, stats = {}, {}
  for backend in ("xla", "pallas_interpret"):
    # layer 0 dense (paged kernel), layer 1 block-sparse: 1 top-k page + bos + 2 recent.
    att = BlockSparse(max_budget=1, page_size=2, dense_layers=(0,), backend=backend)
    eng = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=40, page_size=2,
                                               decode_chunk=3),
                           attention=att)
    outs = eng.generate([Request(p, sp, i) for i, p in enumerate(prompts)])
    tokens[backend] = [list(o.token_ids) for o in outs]
    stats[backend] = eng.last_stats
  assert all(len(t) == 6 for t in tokens["xla"])
  assert tokens["pallas_interpret"] == tokens["xla"]
  assert stats["pallas_interpret"]["decode_steps"] == stats["xla"]["decode_steps"]
