"""torch's flex_attention higher-order op, served by the kernels for calls marked as ours.

torch runs FlexAttention as the higher-order op
``torch.ops.higher_order.flex_attention``: Dynamo traces the mods into graphs and
lifts the tensors they capture into the op's arguments -- under torch.compile,
and in eager mode through a ``torch.compile(backend="eager")`` of the op call,
which caches per mod by Dynamo's guards.  :func:`call` makes such a call with
:data:`MARK` in its ``kernel_options``; :func:`install` makes the op serve
marked calls at its Autograd key (where torch's own implementation builds its
forward and backward graphs; every call with autograd enabled, and every
torch.compile trace, goes through it) and at its dense key (inference mode):
the mods are lowered (:mod:`.lowering`), the BlockMask's lists built
(:mod:`.blocks`) and ``metal_flash::flex_fwd`` called, whose autograd formula
calls ``metal_flash::flex_bwd``.  Under torch.compile those calls are traced like
any op: the compiled graph holds our ops (Inductor runs them as extern kernels),
forward and backward, with no graph break.  Calls without the mark (torch's own
flex_attention) go to torch's implementation unchanged.

What the kernels cannot take (a device without a kernel backend, a dtype or
head dim, a mod that does not lower) runs the dense definition
(:mod:`.reference`, differentiable, traced like the rest under torch.compile)
after the one-time fallback warning, or raises ``UnsupportedError`` in strict
mode.
"""
from __future__ import annotations

import contextvars
import functools
import math
import re
import threading

import torch
from torch._C import DispatchKey
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch._subclasses.fake_tensor import FakeTensor

import torch_metal_flash.backends as backends
from ..planner.tiles import DTYPE_NAMES, MAX_HEAD_DIM
from ..problem.layout import empty_in_layout
import torch_metal_flash.flex.lowering as lowering
from .blocks import kernel_lists
from .reference import dense_flex_attention

# The kernel_options key that marks a call as torch_metal_flash's.
MARK = "TORCH_METAL_FLASH"
_LN2 = math.log(2.0)
_lock = threading.Lock()


def install() -> None:
    """Serve marked calls of torch's flex_attention op (idempotent)."""
    with _lock:
        for key in (DispatchKey.Autograd, DispatchKey.CompositeExplicitAutograd):
            original = flex_attention_hop.py_kernels[key]
            if getattr(original, "_tmf_original", None) is None:
                flex_attention_hop.py_kernels[key] = _serving(original)
        flex_attention_hop._dispatch_cache.clear()


def _serving(original):
    @functools.wraps(original)
    def kernel(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers=(),
               mask_mod_other_buffers=()):
        if not (kernel_options or {}).get(MARK):
            return original(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers,
                            mask_mod_other_buffers)
        return run(query, key, value, score_mod, block_mask, scale, tuple(score_mod_other_buffers),
                   tuple(mask_mod_other_buffers))
    kernel._tmf_original = original
    return kernel


def _hop(*args):
    return flex_attention_hop(*args)


def call(query, key, value, score_mod, block_mask: tuple, scale: float):
    """torch's flex_attention op on a marked call: (out, lse in log2 units)."""
    options = {MARK: True}
    if torch.compiler.is_dynamo_compiling():
        for x in (query, key, value):  # as torch's flex_attention: heads and head dims static
            torch._dynamo.mark_static(x, -3)
            torch._dynamo.mark_static(x, -1)
        out, lse, _ = flex_attention_hop(query, key, value, score_mod, block_mask, scale, options)
        return out, lse
    from torch._higher_order_ops.utils import setup_compilation_env
    with setup_compilation_env() as backend:
        out, lse, _ = torch.compile(_hop, backend=backend, fullgraph=True)(query, key, value, score_mod, block_mask,
                                                                            scale, options)
    return out, lse


def kernel_reason(query, key, value):
    """Why the kernels cannot take these tensors (dtype, head dims), or None."""
    if query.dtype not in DTYPE_NAMES:
        return f"FlexAttention: dtype {query.dtype} is not supported by the kernels (float32, float16, bfloat16)"
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return (f"FlexAttention: head dim {max(query.shape[-1], value.shape[-1])} > {MAX_HEAD_DIM} "
                "(largest kernel tile)")
    return None


# Names of the tensors the mods of the current eager call capture, by id (set by the face).
captured_names: contextvars.ContextVar[dict] = contextvars.ContextVar("tmf_flex_names", default={})


def _placeholders(mod) -> list:
    return [n for n in mod.graph.nodes if n.op == "placeholder"] if isinstance(mod, torch.fx.GraphModule) else []


def _buffers(mod, values: tuple, first: int) -> tuple:
    """The lowering's view of a mod's captured values, named for messages (the face's names of an
    eager call, else Dynamo's placeholders: l_bias_ a local, g_bias_ a global, self_modules_...)."""
    known = captured_names.get()
    nodes = _placeholders(mod)[first:]
    out = []
    for i, t in enumerate(values):
        name = known.get(id(t))
        if name is None and i < len(nodes):
            name = re.sub(r"^[lg]_(.*?)_?$", r"\1", nodes[i].name)
            name = re.sub(r"_(modules|parameters|buffers)_", ".", name).replace("self_", "self.", 1)
        out.append(lowering.Buffer.of(t, repr(name) if name else f"#{i}"))
    return tuple(out)


def _symbolic_size_used(mod, values: tuple, first: int) -> bool:
    """Whether the mod computes with a symbolic int it captured (a dynamic size: its value is not
    known when the kernels are generated)."""
    nodes = _placeholders(mod)[first:]
    return any(isinstance(t, torch.SymInt) and i < len(nodes) and nodes[i].users for i, t in enumerate(values))


def _outputs(out, lse):
    """The op's results from (out, natural-log lse): lse in log2 units, and max_scores, which
    the kernels do not compute (NaN; torch_metal_flash's faces never ask for them)."""
    return out, lse / _LN2, torch.full_like(lse, math.nan)


def run(query, key, value, score_mod, block_mask: tuple, scale: float, score_buffers: tuple, mask_buffers: tuple):
    """A marked call: (out, lse in log2 units, max_scores (not computed))."""
    if isinstance(query, FakeTensor):
        # Dynamo's example values: the call is decided where it runs (eager) or is traced (AOTAutograd),
        # so that an error in eager mode surfaces as itself
        lse = query.new_empty(query.shape[:3], dtype=torch.float32)
        return _outputs(empty_in_layout(query, value.shape[-1]), lse)
    mask_mod = block_mask[-1]
    captured = [t for t in score_buffers + mask_buffers if isinstance(t, torch.Tensor)]
    for t in captured:
        if t.device != query.device:
            raise ValueError(f"flex_attention: the mods capture a tensor on {t.device} (shape {tuple(t.shape)}), the "
                             f"query is on {query.device}: move it to {query.device}")
    chosen, reason = backends.select(query.device)
    mods = None
    if chosen is not None:
        reason = kernel_reason(query, key, value)
        if reason is None and (_symbolic_size_used(score_mod, score_buffers, 5) or
                               _symbolic_size_used(mask_mod, mask_buffers, 4)):
            reason = "FlexAttention: a mod computes with a dynamic size of a captured tensor"
        if reason is None:
            try:
                mods = lowering.lower(score_mod, mask_mod, _buffers(score_mod, score_buffers, 5),
                                      _buffers(mask_mod, mask_buffers, 4))
            except backends.UnsupportedError as e:
                reason = f"FlexAttention: {e}"
    if mods is not None:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
        lists, blocks = kernel_lists(block_mask)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *captured))
        try:
            out, lse, _ = torch.ops.metal_flash.flex_fwd(q, k, v, mods.header, captured, lists, blocks, float(scale),
                                                         needs_grad)
            return _outputs(out, torch.where(lse == math.inf, -math.inf, lse))  # the kernels' empty rows: -inf
        except backends.KernelsUnavailable as e:  # no kernel can be built for the call
            reason = f"FlexAttention: {e.reason}" if not e.reason.startswith("FlexAttention") else e.reason
    if reason is not None:
        backends.fallback(reason)
    out, lse = dense_flex_attention(query, key, value, score_mod, mask_mod, scale, True, score_buffers,
                                    mask_buffers)
    return _outputs(empty_in_layout(query, value.shape[-1]).copy_(out), lse.float())
