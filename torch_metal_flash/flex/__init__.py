"""FlexAttention on the fused kernels: :func:`flex_attention`, and :func:`flex_override`
routing torch's ``flex_attention`` to it (see docs/flex.md).

Modules: :mod:`.attention` (the API), :mod:`.hop` (torch's flex_attention op serving
our calls: eager, compiled, forward and backward), :mod:`.lowering` (score_mod /
mask_mod -> Metal), :mod:`.blocks` (a BlockMask as the kernels walk it),
:mod:`.reference` (the dense definition), :mod:`.override`.
"""
from . import hop
from .attention import flex_attention
from .override import disable_flex, enable_flex, flex_override, is_flex_enabled

hop.install()

__all__ = ["disable_flex", "enable_flex", "flex_attention", "flex_override", "is_flex_enabled"]
