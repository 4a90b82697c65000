"""torch_metal_flash: FlashAttention for PyTorch on Apple-silicon GPUs.

Faces: :func:`scaled_dot_product_attention` (torch semantics),
:func:`flash_attn_func` and friends (flash-attn semantics), the
``torch.ops.metal_flash`` ops, and the integrations.  See the README, and
docs/architecture.md for the layers these subpackages are.
"""
import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys

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

# Modules that moved into the layers' subpackages keep their earlier import paths
# (``torch_metal_flash.spec``, ``torch_metal_flash.kvcache``, ...): the same module objects.
_MOVED = {
    "functional": "faces.functional", "kvcache": "faces.kvcache", "sdpa_override": "faces.sdpa_override",
    "flash_attn_shim": "faces.flash_attn_shim", "_flash_attn_shim": "faces.flash_attn_package",
    "spec": "problem.spec", "layout": "problem.layout", "quant": "problem.quant", "philox": "problem.philox",
    "checks": "problem.checks", "plan": "planner.plan", "paged": "ops.paged",
    "kvcache_reference": "reference.kvcache", "_core_build": "native.build",
}


def _moved_to(name: str):
    """The new full name of an old module path, or None."""
    old, _, rest = name.removeprefix(__name__ + ".").partition(".")
    if not name.startswith(__name__ + ".") or old not in _MOVED:
        return None
    return f"{__name__}.{_MOVED[old]}" + (f".{rest}" if rest else "")


class _OldPaths(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Imports an old module path as the module it names now."""

    def find_spec(self, fullname, path=None, target=None):
        new = _moved_to(fullname)
        return None if new is None else _importlib_util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = _importlib.import_module(_moved_to(spec.name))
        self._own_spec = module.__spec__  # the import system sets __spec__ to the alias's; restored below
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_spec


def __getattr__(name):
    if name in _MOVED:
        return _importlib.import_module(f"{__name__}.{_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from . import _compose  # noqa: E402,F401  (wires the layers' upward callbacks, once)

_sys.meta_path.append(_OldPaths())
for _old, _new in _MOVED.items():  # those already imported: no finder, and no package attribute rebound
    if f"{__name__}.{_new}" in _sys.modules:
        _sys.modules.setdefault(f"{__name__}.{_old}", _sys.modules[f"{__name__}.{_new}"])
