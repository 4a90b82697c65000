"""``flash_attn.flash_attn_interface`` as provided by torch_metal_flash's shim: the ``flash_attn`` (2.x)
package's names, signatures and meaning, on torch_metal_flash's kernels (the faces' own functions)."""
from __future__ import annotations

from ..functional import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                          flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from ..kvcache import flash_attn_with_kvcache

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
# (also _get_block_size_n, which flash-attn's own tests import)


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block size flash-attn's test helpers (``normalize_flash_attn_S``) split
    ``S_dmask`` by: flash-attn's CUDA kernels write each block's probabilities
    relative to the running max of the blocks seen so far; torch_metal_flash writes
    every element relative to its row's final max, which is one block spanning every
    key (the helpers' cumulative max is then the row max)."""
    return 2 ** 31 - 1
