"""Evaluation of a policy on a prompt set: k samples per prompt, avg@k / pass@k / maj@k
(`eval_metrics`), with dense, sparse or sparse+LoRA rollouts; sparse modes also report the
tail of the exact acceptance rate alpha_t of their own rollouts against the dense policy."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from sparrow_jax.agents import agent_metrics, final_answer_ids
from sparrow_jax.models import attention as attn_lib
from sparrow_jax.rl import data as data_lib
from sparrow_jax.rl import rewards as rewards_lib
from sparrow_jax.rl import verifier_pool
from sparrow_jax.rl.eval_metrics import eval_summary, trace_confidence, weighted_maj_at_k
from sparrow_jax.engine.engine import Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.run.builders import encode_prompt
from sparrow_jax.run.producer import make_agent_loop, run_agent

MODES = ("dense", "sparse", "sparse_lora")


def extract_answer(text: str) -> str | None:
  """The answer a sample commits to, for majority voting: last \\boxed{} or the stripped text."""
  boxed = rewards_lib.last_boxed(text)
  ans = boxed if boxed is not None else text.strip()
  return rewards_lib.normalize_answer(ans) or None


class _ScoreOnly:
  """A prune hook that prunes nothing: the engine records each sample's quality-head logit at
  its detection point (ARRoL's test-time use of the head)."""

  def __init__(self, pruner, stop_ids):
    self.detect_len = pruner.config.detect_len
    self.stop_ids = frozenset(stop_ids)
    self.head_params = pruner.params

  def decide(self, group, candidates):
    return [True] * len(candidates)


def _rank_last_unscored(logits) -> list[float]:
  """Head logits of one prompt's samples; a sample the head never scored (it ended at its
  first token, before any decode step) ranks below every scored one."""
  present = [x for x in logits if x is not None]
  low = min(present) - 1.0 if present else 0.0
  return [low if x is None else float(x) for x in logits]


def evaluate(trainer, examples: Sequence[data_lib.PromptExample], *, k: int, mode: str = "dense",
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 1234,
             deepconf_window: int = 2048, deepconf_lowest: float = 0.1) -> dict[str, Any]:
  """k samples per prompt -> avg@k, pass@k, maj@k; weighted votes side by side: by the ARRoL
  quality head's rank weights (when the run trained one) and by DeepConf trace confidence
  (mean of the lowest `deepconf_lowest` windowed confidences, `deepconf_window` tokens,
  from the top-k log-probs the engine keeps, at the sampling `temperature`)."""
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: expected one of {MODES}")
  if mode != "dense" and trainer.schedule.is_dense:
    raise ValueError(f"mode={mode!r} needs a sparse schedule; the config's is dense")
  if mode == "sparse_lora" and trainer.lora is None:
    raise ValueError("mode='sparse_lora' needs a LoRA (distill=true or a checkpoint with one)")
  cfg = trainer.cfg
  engine = trainer.engine
  saved = (engine.attention, engine.schedule)
  if mode == "dense":
    engine.set_attention(attn_lib.Dense(), None)
  lora = trainer.lora if mode == "sparse_lora" else None
  reqs = []
  for i, e in enumerate(examples):
    ids = encode_prompt(trainer.tokenizer, e, cfg.chat_template)
    for j in range(k):
      reqs.append(Request(ids, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                              max_new_tokens=cfg.max_new_tokens,
                                              seed=seed + i * k + j), (i, j)))
  hook = None
  if getattr(trainer, "arrol", None) is not None:
    hook = _ScoreOnly(trainer.arrol, trainer.arrol_stop_ids)
  agent = make_agent_loop(cfg, trainer.tokenizer)  # with `tools`: the training agent loop
  try:
    # (a trainer over several processes splits the prompts between them and gathers)
    if agent is not None:
      comps = run_agent(agent, trainer.rollout, reqs, lora)
    else:
      comps = trainer.rollout.generate(reqs, lora=lora, prune=hook)
  finally:
    engine.set_attention(*saved)
  # a multi-turn trajectory is scored on its answer (after the last tool response)
  texts = [trainer.tokenizer.decode(final_answer_ids(c), skip_special_tokens=True)
           for c in comps]
  res = verifier_pool.score_batch(trainer.reward_fn, texts,
                                  [examples[c.request_id[0]].answer for c in comps],
                                  timeout_s=cfg.reward_timeout_s)
  rewards = np.asarray(res.rewards, np.float32).reshape(len(examples), k)
  answers = [[extract_answer(texts[i * k + j]) for j in range(k)] for i in range(len(examples))]
  out = eval_summary(rewards.tolist(), answers, ks=sorted({1, k}))
  by_prompt = lambda vals: [vals[i * k:(i + 1) * k] for i in range(len(examples))]
  if comps and comps[0].topk_logprobs is not None and comps[0].topk_logprobs.shape[1]:
    conf = [trace_confidence(c.topk_logprobs, window=deepconf_window,
                             lowest_frac=deepconf_lowest) if len(c.token_ids) else 0.0
            for c in comps]
    out[f"eval/deepconf_maj@{k}"] = weighted_maj_at_k(answers, rewards.tolist(),
                                                      by_prompt(conf), k)
  if hook is not None:
    out[f"eval/head_maj@{k}"] = weighted_maj_at_k(
        answers, rewards.tolist(), [_rank_last_unscored(row) for row in by_prompt(
            [c.quality_logit for c in comps])], k, rank=True)
  if agent is not None:
    out.update(agent_metrics(agent.last_records, np.asarray(res.rewards), prefix="eval/agent/"))
  out["eval/mode"] = mode
  out["eval/samples"] = len(comps)
  out["eval/response_len_mean"] = float(np.mean([len(c.token_ids) for c in comps]))
  out["eval/verifier_errors"] = res.num_errors + res.num_timeouts
  if mode != "dense":
    batch = trainer.make_batch(comps)  # micro-batched like the trainer's probe
    out["eval/alpha_p5"] = trainer.learner.tail_alpha(
        trainer.params, batch.arrays("tokens", "lengths", "prompt_lens"), trainer.schedule,
        lora, batch.mask)
  return out
