"""Test setup: 8 fake CPU devices, set before jax is imported anywhere; the parity oracles of the
test extra must be installed (a run without them fails here instead of skipping their tests)."""

import importlib.util
import os

import pytest

TEST_EXTRA = ("torch", "transformers", "hypothesis")  # pytest itself is the fourth

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    missing = [m for m in TEST_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f"the test extra is not installed (missing: {', '.join(missing)}); the parity tests "
            'need it: pip install -e ".[test]"'
        )
