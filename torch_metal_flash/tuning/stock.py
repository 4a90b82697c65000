"""The stock route: torch's own ``F.scaled_dot_product_attention``, timed next to our kernels.

For each problem class the tuner also times torch's SDPA on the same arguments (the
forward for forward and decode classes, forward + backward for backward classes; the
timer is called with the name ``"torch"``) and measures the peak memory of both
routes.  The class is routed to torch only when :func:`verdict` says so:

    torch is faster, and torch's peak stays within WORKING_SET_FRACTION of the
    device's recommended working set.

The tuned problem has one batch row and 8 or 16 heads; a model runs the class with
larger batches and lengths up to 4x longer (a length class), and torch's training path
holds the L x S scores (O(L^2) memory): a sixteenth leaves room for a batch of 16 of
the tuned problem before torch would crowd the working set.  See docs/tuning.md.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

STOCK = "torch"  # the route's name: tmf.tuning.choice(...) -> ("torch", source); tmf.run_counts()["torch"]
WORKING_SET_FRACTION = 1 / 16


def working_set_bytes(device: torch.device) -> int:
    """The memory a process may use on ``device``: Metal's recommended working set on MPS,
    the machine's physical memory elsewhere (the emulator)."""
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def verdict(kernels_seconds: float, torch_seconds: float, torch_peak: int, working_set: int) -> tuple[str, str]:
    """(route, why): ``"torch"`` when torch is faster and its peak memory is within
    WORKING_SET_FRACTION of the working set, else ``"kernels"``."""
    if not torch_seconds < kernels_seconds:
        return "kernels", "the kernels are faster"
    if torch_peak > WORKING_SET_FRACTION * working_set:
        return "kernels", (f"torch is faster but its peak memory {torch_peak / 2**20:.1f} MiB exceeds 1/"
                           f"{round(1 / WORKING_SET_FRACTION)} of the working set ({working_set / 2**20:.0f} MiB)")
    return STOCK, "torch is faster, within the memory rule"


class _PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those the ops inside allocate
    (outputs, intermediates, tensors saved for the backward); not an op's internal scratch."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}  # data_ptr -> (StorageWeakRef, nbytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr in [p for p, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[ptr]
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.live and ptr not in inputs:  # views and in-place results are not new
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def peak_bytes(run: Callable[[], object]) -> int:
    """Peak bytes of the tensors ``run()`` allocates (counted on the host from the ops'
    results: no device query, the same on every backend)."""
    with _PeakBytes() as tracker:
        result = run()
        del result
    return tracker.peak


def original_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    """torch's own SDPA kernel, whatever routes ``F.scaled_dot_product_attention`` (e.g. our
    override): the CompositeImplicitAutograd kernel the operator runs without us."""
    return torch.ops.aten.scaled_dot_product_attention.default._op_dk(
        torch._C.DispatchKey.CompositeImplicitAutograd, query, key, value, attn_mask, dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa)


def torch_runner(problem: dict, device: torch.device, backward: bool) -> Callable[[], object]:
    """torch's SDPA on ``problem``'s arguments as (B, H, L, D) tensors: the forward, or forward +
    backward.  A causal problem with L_q = L_k is torch's ``is_causal``; a decode shape (and any
    L_q != L_k) sees every key, as the bottom-right causal mask of one query row does."""
    dtype = problem["dtype"]
    B, H = int(problem.get("batch", 1)), int(problem.get("heads", 8))
    Hkv = int(problem.get("kv_heads", H))
    Lq, Lk, D = int(problem["seqlen_q"]), int(problem["seqlen_k"]), int(problem["head_dim"])
    Dv = int(problem.get("head_dim_v") or D)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype).to(device).requires_grad_(backward)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype).to(device).requires_grad_(backward)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g).to(dtype).to(device).requires_grad_(backward)
    causal = bool(problem["causal"]) and Lq == Lk
    if not backward:
        def forward():
            with torch.no_grad():
                return original_sdpa(q, k, v, is_causal=causal, enable_gqa=H != Hkv)
        return forward
    dout = torch.randn(B, H, Lq, Dv, generator=g).to(dtype).to(device)

    def forward_backward():
        with torch.enable_grad(), _autograd_dispatch():  # also inside an op's backward (autotuning)
            out = original_sdpa(q, k, v, is_causal=causal, enable_gqa=H != Hkv)
            return torch.autograd.grad(out, (q, k, v), dout)
    return forward_backward


def _autograd_dispatch():
    """Autograd back on when the caller runs below it (an op's kernel planning on a miss
    excludes the autograd dispatch keys for everything it calls)."""
    keys = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if not excluded.has(keys.AutogradFunctionality) and not excluded.has(keys.ADInplaceOrView):
        return contextlib.nullcontext()
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           excluded.remove(keys.AutogradFunctionality).remove(keys.ADInplaceOrView))


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (RuntimeError, MemoryError)) and "out of memory" in str(exc).lower()


def measure(timer: Callable, run: Callable[[], object]) -> tuple[Optional[float], Optional[int], str]:
    """(seconds, peak bytes, "") of torch's route, or (None, None, why) when it runs out of memory."""
    try:
        return float(timer(STOCK, run)), peak_bytes(run), ""
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        return None, None, f"torch ran out of memory: {str(exc).splitlines()[0]}"
