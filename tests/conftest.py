"""Shared pytest setup: float32 matmuls at full precision on CPU, deterministic numpy."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Most tests compile many small programs and run them once: LLVM's backend optimizations cost
# more than they save there (measured: a trainer test 22 -> 17 s, the one long real-model
# forward 56 -> 67 s; the suite's compile-bound part dominates). They change how XLA:CPU
# generates machine code for each fused kernel, not what the HLO computes. Benchmarks and
# real runs keep XLA's default; SPARROW_TEST_XLA_DEFAULT=1 runs the tests with it too.
if (os.environ.get("SPARROW_TEST_XLA_DEFAULT") != "1"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

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


# The longest files first (xdist hands whole files to its 2 workers in this order, with
# `--no-loadscope-reorder`; see pyproject), so that no long file starts last and runs alone
# while the other worker is idle. Ordered by measured duration, longest first; the rest
# follow in collection order.
_LONG_FILES = [
    "tests/engine/test_scheduler.py",
    "tests/test_sparse_rl_study.py",
    "tests/models/test_sparse_decoder.py",
    "tests/engine/test_pruning.py",
    "tests/run/test_trainer_correctness.py",
    "tests/engine/test_engine_sharded.py",
    "tests/run/test_trainer_arrol.py",
    "tests/test_cli.py",
    "tests/run/test_micro_phases.py",
    "tests/run/test_multihost.py",
    "tests/run/test_sharding.py",
    "tests/rl/test_distill.py",
    "tests/calibration/test_calibrate.py",
    "tests/run/test_trainer.py",
    "tests/run/test_eval.py",
    "tests/models/test_smollm2.py",
    "tests/test_gpu_suite.py",
    "tests/test_tpu_suite.py",
]


def pytest_collection_modifyitems(session, config, items):
  rank = {f: i for i, f in enumerate(_LONG_FILES)}
  items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))  # stable
