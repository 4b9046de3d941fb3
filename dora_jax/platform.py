"""Process setup for entry points; imports nothing heavy, so call it before jax is imported."""

import os


def fake_cpu_devices(n: int = 8) -> None:
    """Ask XLA for ``n`` host (CPU) devices unless XLA_FLAGS already sets a count. The flag only
    affects the CPU platform, so it is harmless on GPU/TPU machines."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def release_free_memory() -> None:
    """Hand the memory the C allocator keeps after it was freed back to the operating system
    (glibc's ``malloc_trim``; elsewhere a no-op). A long run frees far more than it holds (step
    batches, checkpoint buffers); glibc keeps most of it, so resident memory creeps up while the
    live heap stays flat. Takes a few milliseconds."""
    global _libc
    if _libc is None:
        import ctypes

        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None
