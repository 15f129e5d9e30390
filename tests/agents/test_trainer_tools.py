"""One training step of the tiny_tools preset end to end: the producer runs the agent loop,
the batch's mask is 0 on the tool responses, the step logs agent/* metrics, the update is
finite, and evaluation runs the same loop."""

import numpy as np

from sparrow_jax.agents import final_answer_ids
from sparrow_jax.run.config import get_train_config
from sparrow_jax.run.evaluate import evaluate
from sparrow_jax.run.trainer import Trainer


def test_tiny_tools_step_masks_tool_responses_and_logs_agent_metrics(tmp_path):
  # every demonstration calls the tool, so the warm-started policy calls it often
  cfg = get_train_config("tiny_tools", [
      f"out_dir={tmp_path}", "warmstart_steps=60", "tool_demo_frac=1.0", "prompts_per_step=4",
      "group_size=4", "num_slots=16", "num_steps=1", "tensorboard=false", "sample_every=0"])
  tr = Trainer(cfg, quiet=True)
  tr.warmstart()
  rec = tr.run_step()
  b, out = rec.batch, rec.out
  assert all(np.isfinite(v) for k, v in out.items()
             if k.startswith("loss/") and isinstance(v, float))
  for k in ("turns_mean", "tool_calls_mean", "tool_errors", "tool_timeouts", "env_token_frac",
            "reward_with_tool", "reward_without_tool"):
    assert f"agent/{k}" in out, k
  assert out["agent/tool_calls_mean"] > 0 and out["agent/env_token_frac"] > 0
  with_env = 0
  for j, c in enumerate(b.completions):
    p, n = len(c.prompt_ids), len(c.token_ids)
    np.testing.assert_array_equal(b.mask[j, p:p + n], c.loss_mask)
    env = np.flatnonzero(c.loss_mask == 0)
    if env.size:
      with_env += 1
      text = tr.tokenizer.decode(c.token_ids[env])
      assert text.startswith("<result ") and text.endswith(">"), text
      assert np.all(b.rollout_logp[j, p + env] == 0)
    assert len(final_answer_ids(c)) <= n
  assert with_env >= 1
  assert np.all(b.mask[:, :int(b.prompt_lens.min())] == 0)
  res = evaluate(tr, tr.examples[:4], k=2, mode="sparse", temperature=1.0)
  assert "eval/agent/tool_calls_mean" in res and res["eval/samples"] == 8
