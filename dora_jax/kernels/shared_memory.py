"""Per-block shared memory limits of NVIDIA GPUs, the budget of the compiled Pallas kernels.

The Triton lowering of ``pl.pallas_call`` stages the tiles a kernel loads in shared memory, one
copy per software-pipeline stage for the loads inside a loop. A kernel whose tiles need more than
the device allows per thread block fails to compile (an "out of resource: shared memory" error).
Every compiled kernel in :mod:`dora_jax.kernels` therefore computes its tile bytes from its shapes,
dtype and tuning (a small pure function per kernel) and shrinks the tuning, or refuses with a
message naming the tuning field, before lowering.

The limits are the opt-in maximum of shared memory per thread block by compute capability, as
the CUDA programming guide tabulates them.
"""

from __future__ import annotations

import functools

import jax

# 227 KiB: the per-block maximum of sm_90 (H100, H200), the device the GPU check targets.
SM90_LIMIT_BYTES = 232_448

_LIMIT_BYTES_BY_CAPABILITY = {
    "8.0": 166_912,  # A100
    "8.6": 101_376,
    "8.7": 166_912,
    "8.9": 101_376,  # L4, L40
    "9.0": SM90_LIMIT_BYTES,
    "10.0": SM90_LIMIT_BYTES,
    "12.0": 101_376,
}


def limit_bytes_for_capability(capability: str | None) -> int:
    """Shared memory per thread block of a compute capability such as "9.0".

    ``None`` (no GPU: interpret mode, or lowering for a GPU from a CPU host) gives the sm_90
    figure; an unknown capability gives the smallest figure in the table, so that the kernels
    shrink their tiles rather than fail to compile.
    """
    if capability is None:
        return SM90_LIMIT_BYTES
    return _LIMIT_BYTES_BY_CAPABILITY.get(str(capability), min(_LIMIT_BYTES_BY_CAPABILITY.values()))


@functools.cache
def device_limit_bytes() -> int:
    """Shared memory per thread block of the first local GPU (see limit_bytes_for_capability)."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU backend in this process
        return limit_bytes_for_capability(None)
    capability = getattr(devices[0], "compute_capability", None) if devices else None
    return limit_bytes_for_capability(capability)
