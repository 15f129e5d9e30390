"""The compiled decode step does not copy or slice the KV pool, nor copy a weight.

A decode step must cost what attention reads (the sequences' own pages, or the selected pages
plus landmarks), not the pool. The pool is the only array with `POOL` pages, so every HLO
instruction whose result has that dimension is checked: only parameters, tuple plumbing, the
while loop, in-place scatters (the token and landmark writes) and bitcasts may produce it.
A `copy`, `slice`, `concatenate`, `dynamic-slice` or a fusion that materialises the pool would
be a per-step cost proportional to the pool size. Likewise a fusion (or copy) that reads a
weight and writes as many elements is a relayout of that weight, redone every step (an einsum
contracting two axes once made XLA transpose every attention output weight per step).
"""

import math

import re

import jax
import jax.numpy as jnp
import pytest

from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.attention import BlockSparse
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model

POOL = 4099  # a page count no other dimension has
_ALLOWED = {"parameter", "get-tuple-element", "tuple", "while", "scatter", "bitcast",
            "conditional", "call"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.+?)\s+([\w-]+)\((.*)$")


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^\s*(?:ENTRY\s+)?%(\S+)\s*\(.*\{\s*$", line)
    if m:
      name = m.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  return comps


def pool_sized_ops(hlo: str, pool: int) -> list[str]:
  """Instructions that produce an array with a `pool` dimension and are not allowed to."""
  comps = _computations(hlo)
  roots = {}
  for name, lines in comps.items():
    for line in lines:
      if line.strip().startswith("ROOT"):
        m = _INSTR.match(line)
        roots[name] = m.group(3) if m else "?"
  bad = []
  for name, lines in comps.items():
    for line in lines:
      m = _INSTR.match(line)
      if not m:
        continue
      shape, op, rest = m.group(2), m.group(3), m.group(4)
      dims = re.findall(r"\[([\d,]*)\]", shape.split("(")[0] if op != "tuple" else shape)
      if not any(str(pool) in d.split(",") for d in dims):
        continue
      if op in _ALLOWED:
        continue
      if op == "fusion":
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called and roots.get(called.group(1)) in ("scatter", "dynamic-update-slice"):
          continue  # an in-place update fused with its index computation
      bad.append(f"{name}: {line.strip()[:160]}")
  return bad


def weight_relayouts(hlo: str, weight_shapes) -> list[str]:
  """Fusions / copies / transposes that read a weight-shaped array and write one as large."""
  shapes = {tuple(s) for s in weight_shapes if len(s) >= 2}
  comps = _computations(hlo)
  param_shapes = {}
  for name, lines in comps.items():
    found = set()
    for line in lines:
      m = _INSTR.match(line)
      if m and m.group(3) == "parameter":
        dims = re.findall(r"\[([\d,]*)\]", m.group(2))
        if dims and dims[0]:
          found.add(tuple(int(x) for x in dims[0].split(",")))
    param_shapes[name] = found
  bad = []
  for name, lines in comps.items():
    for line in lines:
      m = _INSTR.match(line)
      if not m or m.group(3) not in ("fusion", "copy", "transpose"):
        continue
      dims = re.findall(r"\[([\d,]*)\]", m.group(2))
      if len(dims) != 1 or not dims[0]:
        continue
      numel = math.prod(int(x) for x in dims[0].split(","))
      if m.group(3) == "fusion":
        called = re.search(r"calls=%([\w.\-]+)", m.group(4))
        read = param_shapes.get(called.group(1), set()) if called else set()
      else:
        read = {tuple(int(x) for x in d.split(",")) for d in
                re.findall(r"\[([\d,]*)\]", m.group(4).split("metadata")[0]) if d}
      if any(w in shapes and math.prod(w) == numel for w in read):
        bad.append(f"{name}: {line.strip()[:160]}")
  return bad


@pytest.mark.parametrize("attention", [None, BlockSparse(max_budget=2, page_size=16,
                                                         dense_layers=(0,))],
                         ids=["dense", "sparse"])
def test_decode_step_has_no_pool_sized_copy_or_slice(attention):
  cfg = get_config("tiny", eos_token_ids=(), num_layers=3)
  eng = GenerationEngine(init_model(cfg), EngineConfig(num_slots=4, max_seq_len=256,
                                                       num_pages=POOL, decode_chunk=4),
                         attention=attention)
  eng.generate([Request([5, 6, 7] * 20, SamplingParams(temperature=0.0, max_new_tokens=8))])
  b = 4
  cache = eng._kv.replace(page_table=jnp.zeros((b, 8), jnp.int32))
  args = (eng.state, cache, jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool),
          jnp.ones((b,), jnp.int32), jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 2), jnp.uint32),
          jnp.zeros((b,)), jnp.ones((b,)), jnp.zeros((b,), jnp.int32), eng._table(), None)
  hlo = eng._get_decode().lower(*args).compile().as_text()
  assert f"{POOL}" in hlo  # the pool is there (as parameters / loop state)...
  assert pool_sized_ops(hlo, POOL) == []  # ...and nothing copies or slices it
  weights = [x.shape for x in jax.tree.leaves(eng.state)]
  assert weight_relayouts(hlo, weights) == []
  if attention is not None:
    assert scoring_recomputes_query(hlo, cfg, b) == []


def scoring_recomputes_query(hlo: str, cfg, batch: int) -> list[str]:
  """Fusions that score pages (read a layer's landmark pool, other than its in-place write)
  and also read something larger than the group-mean query [B, K, D]: XLA:CPU fused the
  query's projection / RoPE into the per-page loop and recomputed it for every page."""
  pool = f"[{cfg.num_kv_heads},{POOL},{cfg.head_dim}]"
  limit = batch * cfg.num_kv_heads * cfg.head_dim
  bad, scoring = [], 0
  for name, lines in _computations(hlo).items():
    if name.startswith(("wide", "main", "region")):
      continue  # loop bodies and the entry hold the pool as state
    params, root = [], ""
    for line in lines:
      m = _INSTR.match(line)
      if m and m.group(3) == "parameter":
        params.append(m.group(2))
      if line.strip().startswith("ROOT") and m:
        root = m.group(3)
    if root == "scatter" or not any(pool in p for p in params):
      continue
    scoring += 1
    for p in params:
      dims = re.findall(r"\[([\d,]*)\]", p)
      numel = math.prod(int(x) for x in dims[0].split(",")) if dims and dims[0] else 1
      if pool not in p and not p.startswith("s32") and numel > limit:
        bad.append(f"{name}: reads {p}")
  assert scoring, "no page-scoring fusion found"
  return bad


def test_checker_flags_a_pool_copy():
  hlo = """HloModule m
%fused_copy (p: f32[2,4099,16,32]) -> f32[2,4099,16,32] {
  %p = f32[2,4099,16,32]{3,2,1,0} parameter(0)
  ROOT %c = f32[2,4099,16,32]{3,2,1,0} copy(%p)
}
ENTRY %main (a: f32[2,4099,16,32]) -> f32[2,4099,16,32] {
  %a = f32[2,4099,16,32]{3,2,1,0} parameter(0)
  %s = f32[1,4099,16,32]{3,2,1,0} slice(%a), slice={[0:1], [0:4099], [0:16], [0:32]}
  ROOT %f = f32[2,4099,16,32]{3,2,1,0} fusion(%a), kind=kLoop, calls=%fused_copy
}
"""
  bad = pool_sized_ops(hlo, POOL)
  assert len(bad) == 3 and any("slice(" in b for b in bad) and any("copy(" in b for b in bad)


def test_prefill_program_takes_rope_tables_as_input():
  """The prefill's RoPE tables are a program input (`DeviceSteps.prefill_rope`): computed in
  the program, XLA:CPU fused cos/sin into every layer's q and k rope and evaluated them per
  head and per layer. The compiled prefill computes no cosine or sine, and its rows match a
  prefill that computes the tables itself."""
  cfg = get_config("tiny", eos_token_ids=(), num_layers=3)
  model = init_model(cfg)
  eng = GenerationEngine(model, EngineConfig(num_slots=2, max_seq_len=64, decode_chunk=4))
  out = eng.generate([Request(list(range(3, 40)), SamplingParams(temperature=0.0,
                                                                   max_new_tokens=3))])
  n, t = 2, 64
  rope = eng.prefill_rope(t)
  assert rope[0].shape == (t, cfg.head_dim) and t in eng._rope_cache
  cache = eng._pool().replace(page_table=eng._zero_table())
  rows = lambda dt=jnp.int32, *tail: jnp.zeros((n, *tail), dt)
  args = (eng.state, cache, rows(jnp.int32, t), jnp.full((n,), 37, jnp.int32),
          jnp.arange(n, dtype=jnp.int32), rows(jnp.int32, t // 16), rows(jnp.uint32, 2),
          rows(jnp.float32), jnp.ones((n,)), rows(jnp.int32), eng._table(),
          jnp.full((n,), 37, jnp.int32), None, rope)
  hlo = eng._get_prefill(eng.attention).lower(*args).compile().as_text()
  ops = set(re.findall(r"\s(cosine|sine)\(", hlo))
  assert ops == set(), ops
  # the engine's tokens (tables as input) are those of the model's own forward
  toks = list(range(3, 40))
  for _ in range(3):
    logits = model(jnp.asarray([toks]))[0, -1]
    toks.append(int(jnp.argmax(logits)))
  assert list(out[0].token_ids) == toks[37:]
