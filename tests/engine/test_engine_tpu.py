"""A tiny engine rollout through the TPU kernels in TPU interpret mode gives the greedy tokens of
the XLA path: block-sparse layers run `tpu_decode.sparse_decode_tpu`, the dense layer 0 jax's
`ops.tpu.paged_attention` (bf16 cache), all inside the engine's jitted, shard_mapped decode
loop."""

import numpy as np
import pytest

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model


@pytest.mark.slow  # ~80 s: the interpreter traces every layer's kernel
def test_rollout_with_pallas_tpu_interpret_equals_xla():
  model = init_model(get_config("tiny", eos_token_ids=()), seed=3)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 500, n)) for n in (5, 19, 30)]
  sp = SamplingParams(temperature=0.0, max_new_tokens=8)
  tokens, stats = {}, {}
  for backend in ("xla", "pallas_tpu_interpret"):
    # 2 layers: layer 0 dense, layer 1 block-sparse (1 top-k page + bos + 2 recent of 4).
    att = BlockSparse(max_budget=1, page_size=4, dense_layers=(0,), backend=backend)
    eng = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=48, page_size=4,
                                               decode_chunk=4, cache_dtype="bfloat16"),
                           attention=att)
    outs = eng.generate([Request(p, sp, i) for i, p in enumerate(prompts)])
    tokens[backend] = [list(o.token_ids) for o in outs]
    stats[backend] = eng.last_stats
  assert all(len(t) == 8 for t in tokens["xla"])
  assert tokens["pallas_tpu_interpret"] == tokens["xla"]
  assert stats["pallas_tpu_interpret"]["decode_steps"] == stats["xla"]["decode_steps"]
