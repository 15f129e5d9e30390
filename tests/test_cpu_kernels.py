"""The C++ CPU decode kernels (`sparrow_jax.cpu_kernels`) against float64 numpy and the
pure-jnp references, and inside the engine's jitted decode loop against the XLA path."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax import cpu_kernels as ck
from sparrow_jax.engine.engine import EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams
from sparrow_jax.models.attention import BlockSparse, Dense
from sparrow_jax.models.config import get_config
from sparrow_jax.models.decoder import init_model
from sparrow_jax.pallas_kernels import dispatch
from sparrow_jax.pallas_kernels.reference import sparse_decode_reference

# CI machines have g++ (README); a failed build is a failure here, not a skip.
assert ck.available(), ck.unavailable_reason()


def _bf16_round(x):
  return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                    np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lead,k", [((1,), 96), ((3,), 95), ((6,), 96), ((2, 9), 97),
                                    ((203,), 64)], ids=str)
def test_packed_matmul_matches_float64(dtype, lead, k):
  """Row counts across the 6-row register tiles and 96-row blocks, odd K (bf16 panels pad a
  zero row), N not a multiple of the 64-column panels. bfloat16: x and W rounded to bf16, the
  products summed in float32, against float64 sums of the same rounded operands."""
  rng = np.random.default_rng(sum(lead) + k)
  n = 150
  x = rng.standard_normal((*lead, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  wp = ck.pack_weight(w, dtype)
  bf16 = dtype == "bfloat16"
  assert wp.shape == ((3, (k + 1) // 2, 128) if bf16 else (3, k, 64))
  assert wp.dtype == jnp.dtype(dtype)
  y = jax.jit(lambda x, wp: ck.packed_matmul(x, wp, n))(x, wp)
  xref = _bf16_round(x) if bf16 else x.astype(np.float64)
  wref = _bf16_round(w) if bf16 else w.astype(np.float64)
  ref = xref @ wref
  assert y.shape == (*lead, n) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=3e-5)
  if bf16:  # the XLA dot the prefill ran before (bf16 operands, float32 result)
    xla = jnp.einsum("...k,kn->...n", jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                     preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(xla), rtol=1e-5, atol=3e-5)


def test_pack_and_matmul_refuse_bad_input():
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    ck.pack_weight(np.ones((4, 4), np.float32), "float16")
  with pytest.raises(ValueError, match=r"\[K, N\]"):
    ck.pack_weight(np.ones((4, 4, 4), np.float32))
  wp = ck.pack_weight(np.ones((8, 70), np.float32))
  with pytest.raises(ValueError, match="do not match"):
    ck.packed_matmul(jnp.ones((2, 9)), wp, 70)
  with pytest.raises(ValueError, match="do not match"):
    ck.packed_matmul(jnp.ones((2, 8)), wp, 129)
  wb = ck.pack_weight(np.ones((9, 70), np.float32), "bfloat16")  # [2, 5, 128]
  ck.packed_matmul(jnp.ones((2, 10)), wb, 70)  # K = 10 fills the 5 pairs
  with pytest.raises(ValueError, match="do not match"):
    ck.packed_matmul(jnp.ones((2, 11)), wb, 70)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lead,k", [((1,), 96), ((5,), 95), ((203,), 64)], ids=str)
def test_packed_swiglu_matches_float64(dtype, lead, k):
  """silu(x @ gate) * (x @ up) from the fused gate|up packing, rows across the register
  tiles and row blocks, odd K, against float64 on the same (bf16-rounded) operands, and
  against the MLP it replaces (`packed_matmul` of gate|up, then XLA's silu)."""
  rng = np.random.default_rng(k + sum(lead))
  f = 128
  x = rng.standard_normal((*lead, k)).astype(np.float32)
  gate, up = (rng.standard_normal((k, f)).astype(np.float32) / np.sqrt(k) for _ in range(2))
  wp = ck.pack_weight(np.concatenate([gate, up], axis=1), dtype)
  h = jax.jit(lambda x, wp: ck.packed_swiglu(x, wp, f))(x, wp)
  bf16 = dtype == "bfloat16"
  r = _bf16_round if bf16 else (lambda a: a.astype(np.float64))
  g, u = r(x) @ r(gate), r(x) @ r(up)
  ref = g / (1.0 + np.exp(-g)) * u
  assert h.shape == (*lead, f) and h.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(h), ref, rtol=2e-5, atol=2e-6)
  gu = ck.packed_matmul(x, wp, 2 * f)
  two_calls = jax.nn.silu(gu[..., :f]) * gu[..., f:]
  np.testing.assert_allclose(np.asarray(h), np.asarray(two_calls), rtol=2e-5, atol=2e-6)


def test_packed_swiglu_refuses_a_width_off_the_panels():
  assert ck.swiglu_supported(128) and not ck.swiglu_supported(96)
  wp = ck.pack_weight(np.ones((8, 192), np.float32))  # gate|up of width 96: 3 panels
  with pytest.raises(ValueError, match="do not match"):
    ck.packed_swiglu(jnp.ones((2, 8)), wp, 96)
  wp = ck.pack_weight(np.ones((8, 256), np.float32))
  with pytest.raises(ValueError, match="do not match"):
    ck.packed_swiglu(jnp.ones((2, 9)), wp, 128)  # K
  with pytest.raises(ValueError, match="do not match"):
    ck.packed_swiglu(jnp.ones((2, 8)), wp, 64)  # 4 panels are gate|up of width 128


@pytest.mark.parametrize("f", [128, 96], ids=["kernel", "width-off-panels"])
def test_mlp_on_packed_weights_matches_xla(f):
  """The MLP on `pack_decode_weights` copies (float32): the SwiGLU kernel where the width is
  a multiple of 64, gate|up products then XLA's silu otherwise; both the XLA MLP's output."""
  from sparrow_jax.models.decoder import pack_decode_weights
  model = init_model(get_config("tiny", eos_token_ids=(), intermediate_size=f), seed=3)
  packed = pack_decode_weights(model, jnp.float32)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64)), jnp.float32)
  mlp = model.layers[0].mlp
  got = mlp(x, packed=packed["layers"][0])
  np.testing.assert_allclose(np.asarray(got), np.asarray(mlp(x)), rtol=1e-5, atol=1e-5)


def _assert_matches(out, ref_of, q, dtype):
  """float32 cache: the reference on the same q within float32 rounding. bfloat16 cache: the
  kernel rounds q and each page's probabilities to bf16 (pair dot products); against the
  reference on the rounded q, the outputs differ by the probabilities' rounding (2^-9)."""
  if dtype == "float32":
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_of(q)), rtol=2e-5, atol=2e-6)
    return
  err = np.abs(np.asarray(out) - np.asarray(ref_of(q.astype(jnp.bfloat16).astype(jnp.float32))))
  assert err.max() < 1e-2 and err.mean() < 1e-3, (err.max(), err.mean())


def _pool(rng, dtype, *, b=3, h=6, kvh=2, d=64, s=16, pages=40, m=10):
  q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((kvh, pages, s, d)), jnp.float32).astype(dtype)
  v = jnp.asarray(rng.standard_normal((kvh, pages, s, d)), jnp.float32).astype(dtype)
  table = jnp.asarray(1 + rng.permutation(pages - 1)[:b * m].reshape(b, m), jnp.int32)
  return q, k, v, table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("h,kvh", [(6, 2), (10, 1), (3, 3)], ids=["G3", "G10", "G1"])
def test_dense_decode_attention_matches_the_reference(dtype, h, kvh):
  """All of each slot's pages: the sparse reference with every page selected; an empty slot
  (length 0) gives 0, as the dense contract says. Query heads per kv head 3, 10 (more than
  the kernel's group of 8) and 1."""
  rng = np.random.default_rng(0)
  q, k, v, table = _pool(rng, dtype, h=h, kvh=kvh)
  lengths = jnp.asarray([0, 77, 160], jnp.int32)
  out = jax.jit(ck.decode_attention)(q, k, v, table, lengths)
  every = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (3, kvh, 10))
  ref_of = lambda qq: sparse_decode_reference(
      qq, k.astype(jnp.float32), v.astype(jnp.float32), table, lengths, every,
      every * 16 < lengths[:, None, None])[1:]
  _assert_matches(out[1:], ref_of, q, dtype)
  assert np.all(np.asarray(out[0]) == 0)
  # the dispatch entry point the decoder calls
  via = dispatch.dense_decode_attention(q, k, v, table, lengths, backend="cpu")
  np.testing.assert_array_equal(np.asarray(via), np.asarray(out))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sparse_decode_attention_matches_the_reference(dtype):
  """Each kv head's own selected logical pages; invalid entries and pages past the length are
  skipped."""
  rng = np.random.default_rng(1)
  q, k, v, table = _pool(rng, dtype)
  lengths = jnp.asarray([20, 77, 160], jnp.int32)
  idx = np.stack([np.stack([rng.permutation(10)[:4] for _ in range(2)]) for _ in range(3)])
  idx[:, :, 0] = 0  # every selection attends the first page
  valid = rng.random(idx.shape) < 0.7
  valid[:, :, 0] = True
  idx, valid = jnp.asarray(idx, jnp.int32), jnp.asarray(valid)
  out = dispatch.sparse_decode_attention(q, k, v, table, lengths, idx, valid, backend="cpu")
  ref_of = lambda qq: sparse_decode_reference(qq, k.astype(jnp.float32), v.astype(jnp.float32),
                                              table, lengths, idx, valid)
  _assert_matches(out, ref_of, q, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_write_token_is_the_scatter_in_place(dtype):
  """One token per slot into `[KV, P, S, D]` at (dest, off), out-of-range entries dropped:
  the values of `.at[:, dest, off].set(mode="drop")`, inside jit, the input donated."""
  rng = np.random.default_rng(4)
  rnd = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  kb, vb, kr, vr = rnd(2, 9, 16, 64), rnd(2, 9, 16, 64), rnd(2, 4, 64), rnd(2, 4, 64)
  dest = jnp.asarray([3, 9, 0, 5], jnp.int32)  # 9: out of range (an inactive slot)
  off = jnp.asarray([15, 2, 0, 16], jnp.int32)  # 16: out of range
  want = [b.at[:, dest, off].set(r, mode="drop") for b, r in ((kb, kr), (vb, vr))]
  got = jax.jit(ck.cache_write_token, donate_argnums=(0, 1))(jnp.array(kb), jnp.array(vb),
                                                             kr, vr, dest, off)
  for g, w in zip(got, want):
    assert g.dtype == kb.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  assert not np.array_equal(np.asarray(want[0], np.float32), np.asarray(kb, np.float32))
  with pytest.raises(ValueError, match="do not fit"):
    ck.cache_write_token(kb, vb, kr.astype(jnp.float16), vr, dest, off)


def _generate(model, requests, **kw):
  attention = kw.pop("attention")
  schedule = kw.pop("schedule", None)
  eng = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=128, page_size=4,
                                             decode_chunk=5, logprobs_topk=3, **kw),
                         attention=attention, schedule=schedule)
  return eng, eng.generate(requests)


def test_engine_with_the_cpu_kernels_samples_what_the_xla_path_samples():
  """The C++ attention and packed float32 weights inside the engine's jitted decode loop:
  the same sampled tokens (T = 1) and log-probs as XLA's path, dense and block-sparse; with
  bfloat16 decode weights the log-probs move by the weights' rounding only."""
  model = init_model(get_config("tiny", eos_token_ids=()), seed=5)
  rng = np.random.default_rng(2)
  reqs = [Request(list(rng.integers(3, 500, n)), SamplingParams(temperature=1.0,
                                                                 max_new_tokens=24), i)
          for i, n in enumerate((3, 17, 41))]
  sparse = lambda backend: BlockSparse(max_budget=2, page_size=4, dense_layers=(0,),
                                       backend=backend)
  runs = {
      "xla": dict(attention=Dense(backend="xla")),
      "cpu": dict(attention=Dense(backend="cpu"), cpu_decode_weights="float32"),
      "cpu_bf16": dict(attention=Dense(backend="cpu"), cpu_decode_weights="bfloat16"),
      "sparse_xla": dict(attention=sparse("xla"), schedule=2),
      "sparse_cpu": dict(attention=sparse("cpu"), schedule=2,
                         cpu_decode_weights="float32")}
  outs = {name: _generate(model, reqs, **kw)[1] for name, kw in runs.items()}
  for a, b, tol in (("xla", "cpu", 1e-4), ("sparse_xla", "sparse_cpu", 1e-4)):
    for x, y in zip(outs[a], outs[b]):
      assert list(x.token_ids) == list(y.token_ids), (a, b)
      np.testing.assert_allclose(x.logprobs, y.logprobs, atol=tol)
      np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=tol)
  assert [list(o.token_ids) for o in outs["xla"]] != [list(o.token_ids)
                                                      for o in outs["sparse_xla"]]
  # bf16 weights (prefill products in bf16 too): the log-probs of the shared prefix stay
  # within the rounding of the weights and the products' operands
  for x, y in zip(outs["xla"], outs["cpu_bf16"]):
    n = next((i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q),
             len(x.token_ids))
    assert n >= 2
    np.testing.assert_allclose(x.logprobs[:n], y.logprobs[:n], atol=0.05)


def test_set_state_repacks_the_decode_weights():
  """New parameters reach the packed copy: after `set_state`, the engine samples what a fresh
  engine on those parameters samples."""
  from flax import nnx
  cfg = get_config("tiny", eos_token_ids=())
  a, b = init_model(cfg, seed=1), init_model(cfg, seed=2)
  reqs = [Request([5, 6, 7, 8, 9], SamplingParams(temperature=1.0, max_new_tokens=12), 0)]
  kw = dict(attention=Dense(backend="cpu"), cpu_decode_weights="float32")
  eng, _ = _generate(a, reqs, **dict(kw))
  eng.set_state(nnx.state(b))
  got = eng.generate(reqs)[0]
  want = _generate(b, reqs, **dict(kw))[1][0]
  assert list(got.token_ids) == list(want.token_ids)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)


def test_bad_settings_are_refused_with_their_name():
  with pytest.raises(ValueError, match="cpu_decode_weights='int8'"):
    EngineConfig(cpu_decode_weights="int8")
  with pytest.raises(ValueError, match="backend='nope'"):
    Dense(backend="nope")
  from sparrow_jax.run.config import TrainConfig
  with pytest.raises(ValueError, match="cpu_decode_weights"):
    TrainConfig(cpu_decode_weights="int8")


def test_a_missing_compiler_is_named_in_the_error(tmp_path):
  """Without a C++ compiler the kernels are unavailable and asking for them says why."""
  code = ("from sparrow_jax import cpu_kernels as ck\n"
          "from sparrow_jax.engine.engine import EngineConfig, GenerationEngine\n"
          "from sparrow_jax.models.config import get_config\n"
          "from sparrow_jax.models.decoder import init_model\n"
          "assert not ck.available()\n"
          "try:\n"
          "  GenerationEngine(init_model(get_config('tiny')), EngineConfig(cpu_decode_weights="
          "'float32'))\n"
          "except RuntimeError as e:\n"
          "  print('ERR', e)\n")
  env = dict(os.environ, CXX="no-such-compiler-xyz", SPARROW_JAX_KERNEL_CACHE=str(tmp_path))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "ERR" in out.stdout and "no-such-compiler-xyz" in out.stdout, out.stdout


@pytest.mark.parametrize("d,kvh", [(64, 2), (128, 1)])
def test_causal_attention_matches_the_reference(d, kvh):
  """The prefill's causal GQA kernel: float32 reference, a row shorter than the batch (its
  outputs past the length are 0), a length not a multiple of the 64-key blocks."""
  from sparrow_jax.pallas_kernels import train_attention
  rng = np.random.default_rng(d)
  b, t, h = 2, 150, 4
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((b, t, h, d), (b, t, kvh, d), (b, t, kvh, d)))
  lengths = jnp.asarray([t, 67], jnp.int32)
  out = jax.jit(ck.causal_attention)(q, k, v, lengths)
  ref = train_attention.causal_attention(q, k, v, lengths=lengths, impl="reference")
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-6)
  assert np.all(np.asarray(out[1, 67:]) == 0)
  with pytest.raises(ValueError, match="multiple of 64"):
    ck.causal_attention(q[..., :32], k[..., :32], v[..., :32])


@pytest.mark.parametrize("d,kvh", [(64, 3), (128, 1)])
def test_causal_attention_bf16_matches_the_reference_on_rounded_operands(d, kvh):
  """bfloat16 K/V: q rounded to bf16 as well, and each probability before the value product;
  against the float32 reference on the rounded q, k, v, the outputs differ by that last
  rounding only (2^-9 of each weight)."""
  from sparrow_jax.pallas_kernels import train_attention
  rng = np.random.default_rng(d + 1)
  b, t, h = 2, 150, 3 * kvh
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((b, t, h, d), (b, t, kvh, d), (b, t, kvh, d)))
  lengths = jnp.asarray([t, 67], jnp.int32)
  kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  out = jax.jit(ck.causal_attention)(q, kb, vb, lengths)
  r = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  ref = train_attention.causal_attention(r(q), r(k), r(v), lengths=lengths, impl="reference")
  err = np.abs(np.asarray(out) - np.asarray(ref))
  assert err.max() < 1e-2 and err.mean() < 1e-3, (err.max(), err.mean())
  assert np.all(np.asarray(out[1, 67:]) == 0)
  # and it is not the float32 kernel on the unrounded inputs
  f32 = ck.causal_attention(q, k, v, lengths)
  assert np.abs(np.asarray(f32) - np.asarray(out)).max() > 1e-4


def test_kernels_without_avx512_bf16_compute_the_same(tmp_path):
  """Built without AVX512-BF16 (`SPARROW_JAX_CXXFLAGS=-mno-avx512bf16`, as on CPUs that lack
  it) the bf16 matmul, causal and decode attention kernels widen the pairs to float32: the
  same results as the float64 / float32 references on the same rounded operands."""
  code = """
import jax, jax.numpy as jnp, numpy as np
from sparrow_jax import cpu_kernels as ck
from sparrow_jax.pallas_kernels import train_attention
assert ck.available(), ck.unavailable_reason()
rng = np.random.default_rng(0)
x = rng.standard_normal((13, 97)).astype(np.float32)
w = rng.standard_normal((97, 150)).astype(np.float32)
r = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
y = ck.packed_matmul(x, ck.pack_weight(w, "bfloat16"), 150)
print("MATMUL", float(np.max(np.abs(np.asarray(y) - r(x) @ r(w)))))
gu = ck.pack_weight(w[:, :128], "bfloat16")
g, u = r(x) @ r(w[:, :64]), r(x) @ r(w[:, 64:128])
print("SWIGLU", float(np.max(np.abs(np.asarray(ck.packed_swiglu(x, gu, 64)) - g / (1 + np.exp(-g)) * u))))
q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 70, 4, 64), (1, 70, 2, 64), (1, 70, 2, 64)))
out = ck.causal_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
rr = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
ref = train_attention.causal_attention(rr(q), rr(k), rr(v), lengths=jnp.asarray([70]), impl="reference")
print("CAUSAL", float(jnp.max(jnp.abs(out - ref))))
from sparrow_jax.pallas_kernels.reference import sparse_decode_reference
qd = jnp.asarray(rng.standard_normal((2, 6, 64)), jnp.float32)
kc, vc = (jnp.asarray(rng.standard_normal((2, 12, 16, 64)), jnp.bfloat16) for _ in range(2))
table = jnp.asarray(1 + rng.permutation(11)[:10].reshape(2, 5), jnp.int32)
lens = jnp.asarray([37, 80], jnp.int32)
got = ck.decode_attention(qd, kc, vc, table, lens)
every = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 2, 5))
want = sparse_decode_reference(rr(qd), kc.astype(jnp.float32), vc.astype(jnp.float32), table, lens, every, every * 16 < lens[:, None, None])
print("DECODE", float(jnp.max(jnp.abs(got - want))))
"""
  env = dict(os.environ, SPARROW_JAX_CXXFLAGS="-mno-avx512bf16",
             SPARROW_JAX_KERNEL_CACHE=str(tmp_path))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  vals = dict(line.split() for line in out.stdout.splitlines()
              if line[:6] in ("MATMUL", "SWIGLU", "CAUSAL", "DECODE"))
  assert float(vals["MATMUL"]) < 1e-3, out.stdout
  assert float(vals["SWIGLU"]) < 1e-3, out.stdout
  assert float(vals["CAUSAL"]) < 1e-2, out.stdout
  assert float(vals["DECODE"]) < 1e-2, out.stdout
  lib = [f for f in os.listdir(tmp_path) if f.endswith(".so")]
  assert len(lib) == 1  # built here, with the flag (the cache key includes the flags)


def test_engine_prefill_runs_the_cpu_causal_kernel_and_agrees_with_xla(monkeypatch):
  """At head dim 64 the engine's dense prefill takes the C++ causal kernel with
  backend='cpu' (traced into its prefill program), and the sampled tokens and log-probs
  equal the XLA path's."""
  calls = []
  kernel = ck.causal_attention
  monkeypatch.setattr(ck, "causal_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  model = init_model(get_config("tiny", eos_token_ids=(), head_dim=64), seed=4)
  rng = np.random.default_rng(3)
  reqs = [Request(list(rng.integers(3, 500, n)), SamplingParams(temperature=1.0,
                                                                 max_new_tokens=6), i)
          for i, n in enumerate((9, 70))]
  _, out_x = _generate(model, reqs, attention=Dense(backend="xla"))
  assert not calls
  _, out_c = _generate(model, reqs, attention=Dense(backend="cpu"),
                       cpu_decode_weights="float32")
  assert calls and len(calls) % model.cfg.num_layers == 0  # every layer of each prefill trace
  for x, y in zip(out_x, out_c):
    assert list(x.token_ids) == list(y.token_ids)
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
  # bf16 rollout precision (bf16 weights and cache): the prefill attends to K/V as the cache
  # stores them (the bf16 kernel) and writes the cache through the in-place token kernel;
  # the log-probs of the shared prefix stay within bf16 rounding of the XLA path's
  calls.clear()
  bf16 = dict(cache_dtype="bfloat16")
  _, out_xb = _generate(model, reqs, attention=Dense(backend="xla"), **bf16)
  _, out_cb = _generate(model, reqs, attention=Dense(backend="cpu"),
                        cpu_decode_weights="bfloat16", **bf16)
  assert calls
  for x, y in zip(out_xb, out_cb):
    n = next((i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q),
             len(x.token_ids))
    assert n >= 2
    np.testing.assert_allclose(x.logprobs[:n], y.logprobs[:n], atol=0.05)
