"""torch_metal_flash: FlashAttention for PyTorch on Apple-silicon GPUs.

Faces: :func:`scaled_dot_product_attention` (torch semantics),
:func:`flash_attn_func` and friends (flash-attn semantics), the
``torch.ops.metal_flash`` ops, and the integrations.  See the README.
"""
from .backends import FallbackWarning, UnsupportedError, backend, run_counts, set_strict
from .functional import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                         flash_attn_varlen_func, scaled_dot_product_attention)

__version__ = "0.1.0"

__all__ = [
    "FallbackWarning",
    "UnsupportedError",
    "backend",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "run_counts",
    "scaled_dot_product_attention",
    "set_strict",
]
