"""FlexAttention on the fused kernels: :func:`flex_attention`, and :func:`flex_override`
routing torch's ``flex_attention`` to it (see docs/flex.md).

Modules: :mod:`.lowering` (score_mod / mask_mod -> Metal), :mod:`.blocks` (a
BlockMask as the kernels walk it), :mod:`.kernels` (the flex plans), :mod:`.attention`
(the API and its autograd), :mod:`.reference` (the dense definition), :mod:`.override`.
"""
from .attention import flex_attention
from .override import disable_flex, enable_flex, flex_override, is_flex_enabled

__all__ = ["disable_flex", "enable_flex", "flex_attention", "flex_override", "is_flex_enabled"]
