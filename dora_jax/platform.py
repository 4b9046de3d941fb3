"""Process setup for entry points; imports nothing heavy, so call it before jax is imported."""

import os


def fake_cpu_devices(n: int = 8) -> None:
    """Ask XLA for ``n`` host (CPU) devices unless XLA_FLAGS already sets a count. The flag only
    affects the CPU platform, so it is harmless on GPU/TPU machines."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
