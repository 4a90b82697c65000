"""The reference path, plain PyTorch and never the kernels: attention over an
:class:`~torch_metal_flash.problem.spec.AttentionSpec` (:mod:`.attention`) and the
KV-cache decode (:mod:`.kvcache`), both built on the one definition of the band
(:meth:`~torch_metal_flash.problem.spec.AttentionSpec.visible`)."""
from .attention import backward, compute_dtype, forward, probs

__all__ = ["backward", "compute_dtype", "forward", "probs"]
