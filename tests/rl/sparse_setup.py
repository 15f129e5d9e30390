"""A tiny Qwen3 whose block-sparse attention visibly changes its outputs (shared by RL tests).

A random tiny model with the default 0.02 init attends almost uniformly and its logits are
nearly flat, so dropping pages barely changes the next-token distribution (p5 alpha ~0.97).
`sharp_tiny` multiplies every weight matrix by `weight_scale` (sharper attention, larger
residual updates) and the final-norm scale by `logit_scale` (peaked next-token distributions,
entropy ~2.3 nats instead of ~6): with 1 selected page of 16 tokens (+1 bos + 2 recent) on
160-token sequences the p5 acceptance rate is then ~0.5-0.6, well below tau = 0.86.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model


def sharp_tiny(num_layers: int = 4, *, weight_scale: float = 5.0, logit_scale: float = 4.0,
               seed: int = 0):
  """(cfg, graphdef, state) of a 4-layer tiny Qwen3 with scaled weights (see module doc)."""
  cfg = get_config("tiny", num_layers=num_layers)
  graphdef, state = nnx.split(init_model(cfg, seed=seed))

  def scale(path, x):
    names = [str(getattr(p, "key", p)) for p in path]
    if "final_norm" in names:
      return x * logit_scale
    return x * weight_scale if x.ndim >= 2 else x

  return cfg, graphdef, jax.tree_util.tree_map_with_path(scale, state)


def sparse_spec(max_budget: int = 1) -> BlockSparse:
  """Layer 0 dense, layers 1-3 block-sparse (page size 16, 1 bos + 2 recent reserved)."""
  return BlockSparse(max_budget=max_budget, dense_layers=(0,))


def sample_sparse_actor(graphdef, state, lora, key, *, batch: int, seq_len: int,
                        prompt_len: int, budget: int, attention: BlockSparse):
  """On-policy tokens [B, T] sampled from the sparse actor (policy + LoRA) at temperature 1.

  Random prompt tokens, then token t ~ q(. | tokens[:t]) from the teacher-forced sparse
  forward, which selects pages exactly as incremental decode does at step t.
  """
  budgets = jnp.full((batch, seq_len), budget, jnp.int32)

  @jax.jit
  def run(state, lora, key):
    model = nnx.merge(graphdef, state)
    toks = jax.random.randint(key, (batch, seq_len), 3, model.cfg.vocab_size, dtype=jnp.int32)

    def body(t, toks):
      lg = model(toks, attention=attention, budgets=budgets, lora=lora)[:, t - 1]  # [B, V]
      return toks.at[:, t].set(jax.random.categorical(jax.random.fold_in(key, t), lg))

    return jax.lax.fori_loop(prompt_len, seq_len, body, toks)

  return run(state, lora, key)
