"""Multi-turn, tool-using rollouts: tools and their registry (`tools`), tool-call formats
(`formats`), the agent loop over an engine's `generate` (`loop`), and the tool-using
arithmetic task's demonstrations (`tasks`)."""

from sparrow_jax.agents.formats import PlainFormat, Qwen3Format, ToolCall, make_format
from sparrow_jax.agents.loop import AgentLoop, AgentRecord, agent_metrics, final_answer_ids
from sparrow_jax.agents.tools import (PythonInterpreter, Tool, ToolRegistry, ToolResult,
                                      build_registry, calculate)

__all__ = ["AgentLoop", "AgentRecord", "PlainFormat", "PythonInterpreter", "Qwen3Format", "Tool",
           "ToolCall", "ToolRegistry", "ToolResult", "agent_metrics", "build_registry",
           "calculate", "final_answer_ids", "make_format"]
