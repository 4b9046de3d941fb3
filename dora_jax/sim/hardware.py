"""Accelerator presets for the cluster simulator, each number with its source.

Units: FLOP/s, bytes, bytes/s. Bandwidths are *per device and per direction*; the cost model
multiplies them by ``EfficiencyConfig.comm`` (achievable / spec) and by the number of devices
that move data in parallel (a TP group's ranks each send or receive their own shard).

- ``peak_flops``: dense BF16 tensor-core peak (no 2:4 sparsity).
- ``hbm_bytes`` / ``hbm_bw``: device memory capacity and bandwidth.
- ``intra_bw``: the scale-up link a TP group all-reduces over (NVLink / ICI), per direction.
- ``inter_bw``: the scale-out link between groups (weights from the trainer, KV migration):
  the per-GPU NIC for GPUs; ICI for TPU slices, which move data between groups over ICI.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GIB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bw: float
    intra_bw: float
    inter_bw: float
    devices_per_node: int

    def __post_init__(self):
        for f in ("peak_flops", "hbm_bytes", "hbm_bw", "intra_bw", "inter_bw"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{self.name}: {f} must be > 0")


HARDWARE: dict[str, Hardware] = {
    # H800 SXM: the H100 SXM die with NVLink cut to 400 GB/s bidirectional.
    # - 989.5 TFLOPS BF16 dense: NVIDIA H100 SXM datasheet lists 1,979 TFLOPS *with sparsity*;
    #   the H800 keeps the H100's low-precision compute (philisun.com "NVIDIA H800 vs H100").
    # - 80 GB HBM3 at 3.35 TB/s: same memory system as the H100 SXM (NVIDIA H100 datasheet).
    # - NVLink 400 GB/s bidirectional = 200 GB/s per direction (philisun.com, tumgag.com H800
    #   vs H100). DeepSeek-V3 report (arXiv 2412.19437, sec. 3.2.2) measures 160 GB/s usable on
    #   its H800 cluster, i.e. 0.8 of spec: the source of EfficiencyConfig.comm = 0.8.
    # - IB 50 GB/s per GPU (400 Gb/s NIC): DeepSeek-V3 report sec. 3.2.2 ("IB (50 GB/s)").
    "h800": Hardware("H800-SXM", 989.5 * TFLOPS, 80 * GB, 3.35e12, 200 * GB, 50 * GB, 8),
    # H100 SXM: NVIDIA H100 datasheet: 1,979 TFLOPS BF16 with sparsity (989.5 dense), 80 GB HBM3
    # at 3.35 TB/s, NVLink 900 GB/s bidirectional (450 per direction); DGX H100: one 400 Gb/s
    # ConnectX-7 NIC per GPU (50 GB/s).
    "h100": Hardware("H100-SXM", 989.5 * TFLOPS, 80 * GB, 3.35e12, 450 * GB, 50 * GB, 8),
    # H200 SXM: same GH100 compute (989.5 dense BF16; 1,979 with sparsity), 141 GB HBM3e at
    # 4.8 TB/s, NVLink 900 GB/s bidirectional (ai-hpc.github.io "8x H200" and saulelectric.com
    # H200 spec pages, citing NVIDIA); NIC as DGX H100/H200: 400 Gb/s per GPU.
    "h200": Hardware("H200-SXM", 989.5 * TFLOPS, 141 * GB, 4.8e12, 450 * GB, 50 * GB, 8),
    # A100 SXM4 80GB: 312 TFLOPS BF16 dense, 80 GB HBM2e at 2.039 TB/s, NVLink 600 GB/s
    # bidirectional (NVIDIA A100 datasheet, via glennklockwood.com/garden/processors/A100 and the
    # Ampere whitepaper); DGX A100: one 200 Gb/s HDR NIC per GPU (25 GB/s).
    "a100": Hardware("A100-SXM4-80GB", 312 * TFLOPS, 80 * GB, 2.039e12, 300 * GB, 25 * GB, 8),
    # TPU v5p (Cloud TPU docs, "TPU v5p", docs.cloud.google.com/tpu/docs/v5p): 459 TFLOPS BF16,
    # 95 GiB HBM2e at 2,765 GB/s, ICI 1,200 GB/s bidirectional per chip over a 3D torus (600 GB/s
    # per direction over 3 axes). A TP ring uses one axis: 200 GB/s per direction; transfers
    # between groups of one slice also run over ICI (the 50 Gb/s DCN is only between slices).
    # devices_per_node: 4 chips per host.
    "tpu-v5p": Hardware("TPU-v5p", 459 * TFLOPS, 95 * GIB, 2765 * GB, 200 * GB, 200 * GB, 4),
}


def get_hardware(name: str) -> Hardware:
    """The preset called ``name`` (see :data:`HARDWARE`)."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise KeyError(f"unknown hardware {name!r}; presets: {', '.join(HARDWARE)}") from None
