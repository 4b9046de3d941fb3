"""Single-device Pallas kernels with pure-jnp references (no mesh knowledge).

Each op takes an explicit ``impl`` ("reference" or "pallas"; paged attention also "jax_gpu") and
an ``interpret`` flag that runs the Pallas kernel on the CPU.
"""

from dora_jax.kernels.kv_cache_ops import (
    KVCopyTuning,
    append_kv,
    append_kv_chunk,
    pack_pages,
    pack_pages_reference,
    unpack_pages,
    unpack_pages_reference,
)
from dora_jax.kernels.paged_attention import (
    PagedAttentionTuning,
    paged_decode_attention,
    paged_decode_attention_reference,
)

__all__ = [
    "KVCopyTuning",
    "PagedAttentionTuning",
    "append_kv",
    "append_kv_chunk",
    "pack_pages",
    "pack_pages_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "unpack_pages",
    "unpack_pages_reference",
]
