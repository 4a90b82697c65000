"""torch_metal_flash: FlashAttention for PyTorch on Apple-silicon GPUs.

Faces: :func:`scaled_dot_product_attention` (torch semantics),
:func:`flash_attn_func` and friends (flash-attn semantics), the
``torch.ops.metal_flash`` ops, and the integrations.  See the README, and
docs/architecture.md for the layers these subpackages are.
"""
from .native import check_torch as _check_torch

_check_torch()

from . import distributed, emulator, nn, tuning  # noqa: E402
from ._paths import VERSION as __version__
from .backends import FallbackWarning, UnsupportedError, backend, set_strict
from .core import plan_cache_clear, plan_cache_info
from .diagnostics import cache_info, clear_caches, run_counts
from .faces.flash_attn_shim import install_flash_attn_shim, is_flash_attn_shim_installed, uninstall_flash_attn_shim
from .faces.functional import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                               flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                               flash_attn_varlen_qkvpacked_func, scaled_dot_product_attention)
from .faces.kvcache import flash_attn_with_kvcache
from .flex import disable_flex, enable_flex, flex_attention, flex_override, is_flex_enabled
from .faces.sdpa_override import (disable_sdpa, enable_sdpa, is_sdpa_enabled, reset_sdpa_stats, sdpa_override,
                                  sdpa_stats)
from .problem.quant import QuantizedTensor, quantize, quantized_zeros

__all__ = [
    "FallbackWarning",
    "QuantizedTensor",
    "UnsupportedError",
    "backend",
    "cache_info",
    "clear_caches",
    "disable_flex",
    "disable_sdpa",
    "distributed",
    "enable_flex",
    "enable_sdpa",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flex_attention",
    "flex_override",
    "install_flash_attn_shim",
    "is_flash_attn_shim_installed",
    "is_flex_enabled",
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


from . import _compose  # noqa: E402,F401  (wires the layers' upward callbacks, once)
