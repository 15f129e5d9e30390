"""compile_cache_dir turns on JAX's persistent compilation cache: a program compiled once is
written there and read back (a cache hit) by a fresh process with the same program."""

import os
import subprocess
import sys
import textwrap


def test_compile_cache_dir_writes_and_reuses_programs(tmp_path):
  cache = tmp_path / "cache"
  code = textwrap.dedent(f"""
      import jax, jax.numpy as jnp
      from jax._src import monitoring
      from sparrow_jax.run.setup import enable_compile_cache
      hits = []
      monitoring.register_event_listener(
          lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
      assert enable_compile_cache({str(cache)!r}) == {str(cache)!r}
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      f = jax.jit(lambda x: jnp.sin(x) @ x.T + 1.0)
      f(jnp.ones((64, 64))).block_until_ready()
      print("HITS", len(hits))
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
          for _ in range(2)]
  for r in runs:
    assert r.returncode == 0, r.stderr[-2000:]
  assert os.listdir(cache)  # the first process wrote its program
  assert "HITS 0" in runs[0].stdout and "HITS 0" not in runs[1].stdout, (runs[0].stdout,
                                                                          runs[1].stdout)
