"""The supervised warm start: cross-entropy on prompt -> solution pairs before RL, so a
random-init policy earns rewards (`warmstart_steps`, `warmstart_lr`, `warmstart_batch`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparrow_jax.agents import build_registry, make_format
from sparrow_jax.agents.loop import TextCodec
from sparrow_jax.agents.tasks import demo_responses, encode_segments
from sparrow_jax.args import pow2_bucket
from sparrow_jax.rl.logprobs import token_logprobs
from sparrow_jax.rl.tokenizers import ByteTokenizer
from sparrow_jax.run import sharding as sh
from sparrow_jax.run.builders import encode_prompt
from sparrow_jax.run.programs import guarded_apply


def encode_response(tokenizer, text: str, eos: int | None) -> list[int]:
  """A solution's token ids, ending with EOS when the model has one."""
  if isinstance(tokenizer, ByteTokenizer):
    ids = tokenizer.encode(text, add_bos=False)
  else:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
  return ids + ([eos] if eos is not None else [])


def warmstart_pairs(cfg, tokenizer, examples, eos: int | None) -> list[tuple]:
  """(prompt ids, solution ids) of every example (the solution: its metadata's `solution`,
  else the answer); with `tools`, (prompt ids, demonstration ids, loss mask) of the tool
  demonstrations (`agents/tasks.py`: the tool responses' tokens have mask 0)."""
  if cfg.tools:
    return _tool_pairs(cfg, tokenizer, examples, eos)
  return [(encode_prompt(tokenizer, e, cfg.chat_template),
           encode_response(tokenizer, e.metadata.get("solution", e.answer), eos))
          for e in examples]


def _tool_pairs(cfg, tokenizer, examples, eos: int | None) -> list[tuple]:
  reg = build_registry(cfg.tools, python_timeout_s=cfg.tool_timeout_s)
  fmt = make_format(cfg.tool_format, reg, pad_to=cfg.max_tool_response_tokens)
  codec = TextCodec(tokenizer)
  demos = demo_responses(examples, fmt, reg, frac=cfg.tool_demo_frac, seed=cfg.seed + 2)
  return [(encode_prompt(tokenizer, e, cfg.chat_template), *encode_segments(d, codec.encode, eos))
          for e, d in zip(examples, demos)]


def warmstart(cfg, params, graphdef, mesh, param_shardings, pairs,
              init_opt: Callable) -> tuple[object, list[float]]:
  """`warmstart_steps` AdamW steps on random batches of `pairs` -> (params, losses). The
  policy keeps its layout (`param_shardings`): the RL programs compile once for it."""
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(cfg.warmstart_lr))
  opt, opt_shardings = init_opt(tx, params)
  t = pow2_bucket(max(len(x[0]) + len(x[1]) for x in pairs), 32)

  def sft(params, opt_state, tokens, lengths, mask):
    def loss_fn(p):
      lp = token_logprobs(nnx.merge(graphdef, p), tokens, lengths=lengths,
                          chunk=cfg.logprob_chunk).logp
      return -jnp.sum(lp * mask) / jnp.maximum(jnp.sum(mask), 1)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    params, opt_state, _, _ = guarded_apply(tx, params, opt_state, grads, loss)
    return params, opt_state, loss

  sft = jax.jit(sft, donate_argnums=(0, 1), out_shardings=(
      param_shardings, opt_shardings, sh.replicated(mesh)))
  rng = np.random.default_rng(cfg.seed + 1)
  losses = []
  for _ in range(cfg.warmstart_steps):
    idx = rng.integers(0, len(pairs), cfg.warmstart_batch)
    tokens = np.zeros((len(idx), t), np.int32)
    mask = np.zeros((len(idx), t), np.float32)
    lengths = np.zeros((len(idx),), np.int32)
    for j, i in enumerate(idx):
      p, r, *m = pairs[i]  # m: the response's loss mask (tool demonstrations)
      tokens[j, :len(p)] = p
      tokens[j, len(p):len(p) + len(r)] = r
      mask[j, len(p):len(p) + len(r)] = m[0] if m else 1
      lengths[j] = len(p) + len(r)
    params, opt, loss = sft(params, opt, jnp.asarray(tokens), jnp.asarray(lengths),
                            jnp.asarray(mask))
    losses.append(float(loss))
  return params, losses
