"""LoRA adapters of the sparse actor: config validation, layout, zero-B exactness, counts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.models.lora import (TARGETS, LoRAConfig, LoRAScale, check_lora, init_lora,
                                     lora_norms, lora_param_count, target_shapes)


def _hand_count(cfg, r, layers):
  d, n, k, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  per_layer = (r * (d + n * h)          # q: A [D, r], B [r, N, H]
               + 2 * r * (d + k * h)    # k, v
               + r * (n * h + d)        # o: A [N, H, r], B [r, D]
               + 2 * r * (d + f)        # gate, up
               + r * (f + d))           # down
  return per_layer * layers


def test_config_validation_names_field_and_value():
  with pytest.raises(ValueError, match="unknown target 'qkv'"):
    LoRAConfig(targets=("q", "qkv"))
  with pytest.raises(ValueError, match="rank=0"):
    LoRAConfig(rank=0)
  with pytest.raises(ValueError, match="alpha=-1"):
    LoRAConfig(alpha=-1.0)
  with pytest.raises(ValueError, match="duplicates"):
    LoRAConfig(targets=("q", "q"))
  with pytest.raises(ValueError, match="init_std"):
    LoRAConfig(init_std=0.0)
  with pytest.raises(ValueError, match=r"layer\(s\) \[5\] do not exist"):
    init_lora(get_config("tiny"), LoRAConfig(layers=(0, 5)), jax.random.key(0))
  # A comma-separated string (the CLI form) is accepted and put in canonical order.
  assert LoRAConfig(targets="v,q").targets == ("q", "v")
  assert LoRAConfig(rank=4, alpha=8).scale == 2.0


@pytest.mark.parametrize("rank,targets,layers", [
    (8, TARGETS, None), (4, ("q", "v"), (1,)), (2, ("o", "down"), (0, 1))])
def test_init_layout_and_param_counts(rank, targets, layers):
  cfg = get_config("tiny")
  lcfg = LoRAConfig(rank=rank, alpha=16.0, targets=targets, layers=layers)
  lora = init_lora(cfg, lcfg, jax.random.key(0))
  check_lora(lora, cfg)
  n_layers = cfg.num_layers if layers is None else len(layers)
  if targets == TARGETS:
    assert lora_param_count(lora) == _hand_count(cfg, rank, n_layers) == 19456
  assert lora_param_count(lora) == lcfg.num_params(cfg)
  # Only A and B are leaves; the scale is static.
  assert len(jax.tree.leaves(lora)) == 2 * len(targets) * n_layers
  shapes = target_shapes(cfg, rank)
  for i, entry in enumerate(lora["layers"]):
    assert set(entry) == (set(targets) if layers is None or i in layers else set())
    for t, pair in entry.items():
      chex.assert_shape(pair["a"], shapes[t][0])
      chex.assert_shape(pair["b"], shapes[t][1])
      assert pair["a"].dtype == pair["b"].dtype == jnp.float32
      assert not np.any(np.asarray(pair["b"])) and np.all(np.isfinite(pair["a"]))
      assert float(np.std(pair["a"])) > 0
      assert isinstance(pair["scale"], LoRAScale) and float(pair["scale"]) == 16.0 / rank
  assert float(lora_norms(lora)["b_norm"]) == 0.0


def test_check_lora_rejects_bad_shapes():
  cfg = get_config("tiny")
  lora = init_lora(cfg, LoRAConfig(rank=2, targets=("q",)), jax.random.key(0))
  lora["layers"][1]["q"]["b"] = jnp.zeros((2, 3, 32))
  with pytest.raises(ValueError, match=r"lora\['layers'\]\[1\]\['q'\]"):
    check_lora(lora, cfg)


def _perturb_b(lora, key, std=0.05):
  leaves, tree = jax.tree.flatten(lora)
  keys = jax.random.split(key, len(leaves))
  out, paths = [], jax.tree_util.tree_flatten_with_path(lora)[0]
  for (path, x), k in zip(paths, keys):
    is_b = str(getattr(path[-1], "key", "")) == "b"
    out.append(x + std * jax.random.normal(k, x.shape) if is_b else x)
  return jax.tree.unflatten(tree, out)


def test_zero_b_is_exact_and_nonzero_b_changes_logits():
  cfg = get_config("tiny", num_layers=4)
  model = init_model(cfg, seed=1)
  graphdef, state = nnx.split(model)
  t = 80  # 5 pages > 1 selected + 1 bos + 2 recent: layers 1-3 really are sparse
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
  budgets = jnp.ones((2, t), jnp.int32)
  sparse = BlockSparse(max_budget=1, dense_layers=(0,))

  def fwd(state, lora, sparse_on):
    m = nnx.merge(graphdef, state)
    if sparse_on:
      return m(tokens, attention=sparse, budgets=budgets, lora=lora)
    return m(tokens, lora=lora)

  fwd = jax.jit(fwd, static_argnums=2)
  lora = init_lora(cfg, LoRAConfig(rank=4), jax.random.key(3))
  dense0, dense_l = fwd(state, None, False), fwd(state, lora, False)
  sparse0, sparse_l = fwd(state, None, True), fwd(state, lora, True)
  assert not np.array_equal(dense0, sparse0)  # the sparse path differs from dense at all
  # Bitwise: y + scale * (x A) 0 == y.
  np.testing.assert_array_equal(np.asarray(sparse_l), np.asarray(sparse0))
  np.testing.assert_array_equal(np.asarray(dense_l), np.asarray(dense0))
  lora_nz = _perturb_b(lora, jax.random.key(4))
  assert float(lora_norms(lora_nz)["b_norm"]) > 0
  for on, base in ((True, sparse0), (False, dense0)):
    diff = np.abs(np.asarray(fwd(state, lora_nz, on)) - np.asarray(base)).max()
    assert diff > 1e-3, diff


def test_zero_b_rollout_equals_sparse_rollout():
  """The rollout path (paged prefill + block-sparse decode) with a fresh adapter reproduces
  the sparse actor's tokens and log-probs bit for bit."""
  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
  from sparrow_jax.engine.sampling import SamplingParams

  cfg = get_config("tiny", num_layers=4)
  model = init_model(cfg, seed=1)
  engine = GenerationEngine(
      model, EngineConfig(num_slots=2, max_seq_len=128, decode_chunk=16, logprobs_topk=4),
      attention=BlockSparse(max_budget=1, dense_layers=(0,)), schedule=1)
  rng = np.random.default_rng(5)
  reqs = [Request(prompt_ids=rng.integers(3, cfg.vocab_size, 20).tolist(),
                  sampling=SamplingParams(temperature=1.0, max_new_tokens=70, seed=i,
                                          ignore_eos=True)) for i in range(2)]
  base = engine.generate(reqs)
  lora = init_lora(cfg, LoRAConfig(rank=4), jax.random.key(0))
  with_lora = engine.generate(reqs, lora=lora)
  for a, b in zip(base, with_lora):
    assert len(a.token_ids) == 70
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)
  changed = engine.generate(reqs, lora=_perturb_b(lora, jax.random.key(1), std=0.5))
  assert any(not np.array_equal(a.logprobs, c.logprobs) for a, c in zip(base, changed))
