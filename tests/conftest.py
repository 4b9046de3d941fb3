"""Test setup: 8 fake CPU devices, set before jax is imported anywhere; the parity oracles of the
test extra must be installed (a run without them fails here instead of skipping their tests)."""

import importlib.util
import os

import pytest

TEST_EXTRA = ("torch", "transformers", "accelerate", "hypothesis")  # and pytest itself

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Many tests build the same tiny run, and each build traces its own jitted functions, so XLA
# compiles identical programs again and again, in this process, in the other xdist worker and in
# every run a test starts as a subprocess. One compilation cache for the whole session (a fresh
# directory, removed at exit by the process that made it) serves those repeats from disk: it is set
# in the environment before jax is imported, so the workers and the subprocess runs read and write
# the same one. The programs are the ones XLA would compile, the jit caches and their counts are
# untouched. No size limit: with one, jax takes a file lock and lists the directory at every write,
# and a wall-clock overlap test then failed 1 run in 3 alone (0 in 4 without it). An entry read
# while another process writes it fails to load, which jax answers with a warning and a compile. An
# outside JAX_COMPILATION_CACHE_DIR is left as the user set it.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _CACHE = tempfile.mkdtemp(prefix="dora_jax-tests-xla-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    missing = [m for m in TEST_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f"the test extra is not installed (missing: {', '.join(missing)}); the parity tests "
            'need it: pip install -e ".[test]"'
        )
    # Property tests draw the same examples on every run (a failure found is found again, and a
    # run never fails by the luck of its draw); HYPOTHESIS_PROFILE=explore draws fresh ones, as
    # the slow sweeps always do.
    from hypothesis import settings

    settings.register_profile("suite", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


MAPS_LIMIT = 30_000  # memory mappings of this process before compiled programs are dropped


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to count
        return 0


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drop JAX's compiled programs after a test module once this process holds many memory
    mappings. Every XLA CPU executable keeps some, one process running the whole suite compiles
    thousands (measured: over 19,000 mappings a fifth of the way through), and past
    vm.max_map_count (65,530 by default) the process is aborted, which happened inside an XLA
    compile near the end of the suite. Dropping them only then keeps the programs that later
    modules reuse compiled."""
    yield
    if _memory_maps() > MAPS_LIMIT:
        jax.clear_caches()
