"""Process setup for entry points; imports nothing heavy, so call it before jax is imported."""

import os


def fake_cpu_devices(n: int = 8) -> None:
    """Ask XLA for ``n`` host (CPU) devices unless XLA_FLAGS already sets a count. The flag only
    affects the CPU platform, so it is harmless on GPU/TPU machines."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def limit_malloc_arenas(n: int = MALLOC_ARENAS) -> None:
    """Let glibc's allocator keep at most ``n`` arenas (unless ``MALLOC_ARENA_MAX`` is set; a
    no-op where glibc is not the C library). By default glibc opens up to eight arenas per core,
    one per thread that allocates at once, and XLA runs dozens of threads: each arena keeps the
    pages its threads freed, so over a long run resident memory creeps up while the live heap
    stays flat (benchmarks/bench_soak.py, steps 100 to 1,000: +8% with glibc's default, +0.6%
    with two arenas). Call it before jax starts its threads."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    libc = _load_libc()
    if libc:
        libc.mallopt(_M_ARENA_MAX, n)


def _load_libc():
    global _libc
    if _libc is None:
        import ctypes

        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    return _libc


def release_free_memory() -> None:
    """Hand the memory the C allocator keeps after it was freed back to the operating system
    (glibc's ``malloc_trim``; elsewhere a no-op). A long run frees far more than it holds (step
    batches, checkpoint buffers); glibc keeps most of it, so resident memory creeps up while the
    live heap stays flat. Takes a few milliseconds."""
    libc = _load_libc()
    if libc:
        libc.malloc_trim(0)


_libc = None


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's feature flags, in the order ``cpuinfo`` lists them (its first ``flags`` line);
    empty where the file cannot be read or has none."""
    try:
        with open(cpuinfo) as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return []
    return line.split(":", 1)[-1].split()


def cpu_bfloat16_note(compute_dtype: str, platform: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """A line for a 16-bit model on a CPU whose flags name no bfloat16 dot-product
    instructions (``avx512_bf16``, ``amx_bf16``): there its products run no faster than in
    float32 and the conversions around them make the step slower (measured on an AVX2-only
    host: XLA's bfloat16 products at 0.25x-1.0x of its float32 ones). Empty otherwise, and where
    the flags cannot be read."""
    if compute_dtype == "float32" or platform != "cpu":
        return ""
    flags = cpu_flags(cpuinfo)
    if not flags or any(flag in flags for flag in BF16_CPU_FLAGS):
        return ""
    return (
        f"model.compute_dtype={compute_dtype} on a CPU without bfloat16 dot-product "
        f"instructions ({' or '.join(BF16_CPU_FLAGS)} in {cpuinfo}): expect it slower than "
        "model.compute_dtype=float32 on this machine"
    )
