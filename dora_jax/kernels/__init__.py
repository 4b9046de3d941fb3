"""Single-device Pallas kernels with pure-jnp references (no mesh knowledge).

Each op takes an explicit ``impl`` ("reference" or "pallas"; paged attention also "jax_gpu") and
an ``interpret`` flag that runs the Pallas kernel on the CPU. Compiled for a GPU, each kernel's
tuning is first fitted to the device's shared memory per block (``shared_memory``; the
``*_shared_memory_bytes`` functions give each kernel's tile bytes).
"""

from dora_jax.kernels.kv_cache_ops import (
    KVCopyTuning,
    append_kv,
    append_kv_chunk,
    append_shared_memory_bytes,
    fit_copy_tuning,
    pack_pages,
    pack_pages_reference,
    page_copy_shared_memory_bytes,
    unpack_pages,
    unpack_pages_reference,
)
from dora_jax.kernels.paged_attention import (
    PagedAttentionTuning,
    attention_shared_memory_bytes,
    fit_attention_tuning,
    paged_decode_attention,
    paged_decode_attention_reference,
)

__all__ = [
    "KVCopyTuning",
    "PagedAttentionTuning",
    "append_kv",
    "append_kv_chunk",
    "append_shared_memory_bytes",
    "attention_shared_memory_bytes",
    "fit_attention_tuning",
    "fit_copy_tuning",
    "pack_pages",
    "pack_pages_reference",
    "page_copy_shared_memory_bytes",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "unpack_pages",
    "unpack_pages_reference",
]
