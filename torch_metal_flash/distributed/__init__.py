"""Attention over a sequence sharded across processes (ring attention on torch.distributed).

* :func:`ring_attention`: exact attention, forward and backward, of this rank's rows of a
  sequence whose rows are split over the ranks of a process group, with our kernels per
  block and log-sum-exp merges (:mod:`.ring`); the blocks travel with torch.distributed's
  point-to-point operations, staged through the CPU for gloo (:mod:`.transport`).
* :func:`zigzag_shard` / :func:`zigzag_unshard`: the head-tail layout that balances a
  causal mask's work over the ranks (``load_balance=True``; :mod:`.layout`).

How to run it on several Macs: docs/distributed.md.
"""
from .layout import zigzag_shard, zigzag_unshard
from .ring import ring_attention, ring_attention_with_lse

__all__ = ["ring_attention", "ring_attention_with_lse", "zigzag_shard", "zigzag_unshard"]
