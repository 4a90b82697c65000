"""The ``flash_attn`` package API on torch_metal_flash (installed as ``flash_attn`` in
``sys.modules`` by :func:`torch_metal_flash.faces.flash_attn_shim.install_flash_attn_shim`,
never on import).

``__version__`` is the flash-attn API level the shim follows (some code gates
features such as softcap or sliding windows on it), not a version of the
CUDA package.
"""
from . import flash_attn_interface
from .flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                   flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                   flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__version__ = "2.8.3"
__torch_metal_flash_shim__ = True

__all__ = list(flash_attn_interface.__all__)
