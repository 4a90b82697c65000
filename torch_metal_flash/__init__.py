"""torch_metal_flash: FlashAttention for PyTorch on Apple-silicon GPUs.

Faces: :func:`scaled_dot_product_attention` (torch semantics),
:func:`flash_attn_func` and friends (flash-attn semantics), the
``torch.ops.metal_flash`` ops, and the integrations.  See the README.
"""
from .backends import FallbackWarning, UnsupportedError, backend, run_counts, set_strict
from .caches import cache_info, clear_caches
from . import emulator, nn, tuning
from .core import plan_cache_clear, plan_cache_info
from .flash_attn_shim import install_flash_attn_shim, is_flash_attn_shim_installed, uninstall_flash_attn_shim
from .functional import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                         flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                         scaled_dot_product_attention)
from .kvcache import flash_attn_with_kvcache
from .quant import QuantizedTensor, quantize, quantized_zeros
from .sdpa_override import (disable_sdpa, enable_sdpa, is_sdpa_enabled, reset_sdpa_stats, sdpa_override,
                            sdpa_stats)

__version__ = "0.1.0"

__all__ = [
    "FallbackWarning",
    "QuantizedTensor",
    "UnsupportedError",
    "backend",
    "cache_info",
    "clear_caches",
    "disable_sdpa",
    "enable_sdpa",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install_flash_attn_shim",
    "is_flash_attn_shim_installed",
    "is_sdpa_enabled",
    "nn",
    "plan_cache_clear",
    "plan_cache_info",
    "quantize",
    "quantized_zeros",
    "reset_sdpa_stats",
    "run_counts",
    "scaled_dot_product_attention",
    "sdpa_override",
    "sdpa_stats",
    "tuning",
    "emulator",
    "set_strict",
    "uninstall_flash_attn_shim",
]
