"""Shared pytest setup: float32 matmuls at full precision on CPU, deterministic numpy."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Many tests build trainers/engines that compile the same programs again (new jitted closures,
# identical HLO). A persistent compilation cache for the session turns those into cache hits.
import tempfile  # noqa: E402

# xdist workers of one run share it (PYTEST_XDIST_TESTRUNUID is common to them).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_CACHE = (os.environ.get("SPARROW_TEST_JAX_CACHE")
          or (os.path.join(tempfile.gettempdir(), f"sparrow_jax_cache_{_RUN}") if _RUN
              else tempfile.mkdtemp(prefix="sparrow_jax_cache_")))
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
