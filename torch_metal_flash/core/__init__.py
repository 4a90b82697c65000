"""The C++ op core (``csrc/core``): its op table, its callbacks into Python, loading it.

An op whose body runs in C++ is a ``torch.library`` op plus a :class:`CoreOp`
registered here: how to allocate its outputs, how to plan it (the planner, the
single source of truth), and its reference path.  The core registers one
generic boxed kernel for the op's CPU and MPS keys.  A call builds a plan-cache
key by walking its arguments (dtypes, sizes, strides, alignment and aliasing
classes, None-ness, scalars) plus the encoder; on a hit it allocates outputs
and scratch, binds them and encodes, with no Python; on a miss it calls
:func:`_on_miss` once, which plans in Python and turns the :class:`~.plan.Plan`
into a template (every bound tensor named as an argument, an output or
scratch).  Backend choice, fallbacks, strict mode and :func:`~.backends.run_counts`
behave as in :mod:`.backends`: the C++ side mirrors each thread's choice and
calls back here for everything but the kernels.

Adding an op (the seam): define it with ``torch.library.custom_op`` whose body
is ``core.python_body(MY_OP, args)``, register its fake kernel, then
``register(CoreOp("ns::name", outputs=..., plan=..., reference=...))``.  Its
schema may use Tensor, Tensor?, int, float, bool, int[] and str arguments and
return tensors; mutated arguments are bound as arguments.

The core is part of ``torch_metal_flash._C`` on macOS (next to the Metal
encoder); elsewhere it is built at first use (:mod:`torch_metal_flash.native.build`) and serves
CPU tensors behind the emulator backend.  ``TORCH_METAL_FLASH_PLAN_CACHE_SIZE``
bounds the cache (default 512 templates); ``TORCH_METAL_FLASH_PLAN_CACHE_VERIFY=1``
re-plans every hit and raises if the template differs (the test suite runs so).
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Callable, Optional, Union

import torch

import torch_metal_flash.backends as backends
import torch_metal_flash.caches as caches
import torch_metal_flash.native as native
from ..planner.plan import Plan, Unsupported

__all__ = ["CoreOp", "register", "load", "loaded", "plan_cache_info", "plan_cache_clear", "configure_plan_cache",
           "python_body"]


@dataclasses.dataclass(frozen=True)
class CoreOp:
    """An op whose body is the C++ core.

    ``outputs(*args)`` allocates the op's outputs (the fake kernel uses it too, so
    the strides match); ``plan(backend, args, outputs)`` (``backend.family``: the
    tile tables; ``backend.pipeline_info``: the pipelines' limits) returns a
    :class:`~.plan.Plan`, :class:`~.plan.Unsupported` (fallback with the reason) or
    None (nothing for a kernel to do: the reference path, silently);
    ``reference(*args)`` returns the outputs computed on the reference path.
    ``setup_context``/``backward``: the autograd formula.  The core's C++ autograd
    kernel lets calls that need no graph through without Python and runs calls
    that do through an ``autograd.Function`` made of this formula; other devices
    use it through ``torch.library.register_autograd``.
    """

    name: str
    outputs: Callable[..., tuple]
    plan: Callable[[object, tuple, tuple], Union[Plan, Unsupported, None]]
    reference: Callable[..., tuple]
    # The autograd formula, as for torch.library.register_autograd (None: not differentiable).
    setup_context: Optional[Callable] = None
    backward: Optional[Callable] = None
    # Host validation of argument *values* before the kernels run, with TORCH_METAL_FLASH_DEBUG=1
    # only (it reads device tensors: a GPU synchronisation on MPS).
    debug_check: Optional[Callable[..., None]] = None


_OPS: list[CoreOp] = []
_INDEX: dict[str, int] = {}  # name -> position in _OPS (= the C++ op index)
_ext = None
_lock = threading.Lock()

# RefKind of csrc/core/core.h
_ARG, _OUTPUT, _SCRATCH, _TENSOR = 0, 1, 2, 4
# bridge::Why of csrc/core/bridge.h
_WHY_SELECTED, _WHY_ROUTE, _WHY_UNSUPPORTED, _WHY_EMPTY = range(4)


_AUTOGRAD: list = []  # per op: the apply of its autograd.Function


def register(op: CoreOp) -> CoreOp:
    """Add ``op`` to the core (now, or when the core loads)."""
    with _lock:
        if any(o.name == op.name for o in _OPS):
            raise ValueError(f"{op.name} is already registered with the core")
        if op.backward is not None:
            torch.library.register_autograd(op.name, op.backward, setup_context=op.setup_context)
        _INDEX[op.name] = len(_OPS)
        _OPS.append(op)
        _AUTOGRAD.append(_autograd_function(op))
        if _ext is not None:
            _register_with(_ext, len(_OPS) - 1)
    return op


def _autograd_function(op: CoreOp) -> Callable:
    """``apply`` of an autograd.Function that runs ``op`` below autograd and
    differentiates it with its formula (what torch.library builds for custom ops)."""
    ns, name = op.name.split("::")
    overload = getattr(getattr(torch.ops, ns), name).default

    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = overload(*args)
        if op.setup_context is not None:
            op.setup_context(ctx, args, output)
        return output

    def backward(ctx, *grads):
        if op.backward is None:
            raise RuntimeError(f"Trying to backward through {op.name} but no autograd formula was registered.")
        return op.backward(ctx, *grads)

    function = type(f"Autograd_{ns}_{name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    return function.apply


def _register_with(ext, index: int) -> None:
    got = ext.core.register_op(_OPS[index].name, _OPS[index].debug_check is not None)
    if got != index:
        raise RuntimeError(f"torch_metal_flash core: {_OPS[index].name} got index {got}, expected {index}")


def _transpose_12(a, b, c):
    return a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2)


# (a, b, c) with dims 1 and 2 swapped (the flash-attn faces' views of q, k, v): in C++ once
# the core is loaded, one call instead of three Python-level view ops.
transpose_12 = _transpose_12


def load():
    """The extension module holding the core (``_C`` on macOS, else built at first use)."""
    global _ext, transpose_12
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is None:
            ext = native.core_extension()
            ext.core.init(_on_miss, _reference, _autograd, _debug_check, _current_choice, _emulator_prepare,
                          _emulator_encode)
            for i in range(len(_OPS)):
                _register_with(ext, i)
            transpose_12 = getattr(ext.core, "transpose_12", _transpose_12)
            for hook in _on_load:
                hook(ext)
            _ext = ext
    return _ext


def loaded() -> bool:
    return _ext is not None


_on_load: list[Callable] = []


def when_loaded(hook: Callable) -> None:
    """Call ``hook(ext)`` as the core loads, or now if it has (layers above it, e.g. tuning, hand it their state)."""
    with _lock:
        _on_load.append(hook)
        ext = _ext
    if ext is not None:
        hook(ext)


def _serves(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "mps" and load().core.has_encoder("metal"))


def python_body(op: CoreOp, args: tuple):
    """The op's Python body: reached only while the core does not serve the call's
    device (not loaded yet, or another device such as CUDA).  Loads the core when a
    kernel backend is selected and hands the call over; else runs the reference."""
    device = _device(args)
    backend, why = backends.select(device)
    if backend is not None and _serves(device):
        return tuple(load().core.call(_index(op), args))
    if why is not None:
        backends.fallback(why)
    backends.record_run("reference")
    return op.reference(*args)


def probe(op: CoreOp, backend_name: str, args: tuple) -> Optional[str]:
    """None when ``backend_name`` runs the op's kernels for ``args``, else why not.
    Answered from the plan cache (the planner runs on a miss); warns about nothing."""
    return load().core.probe(_index(op), backend_name, args)


def run_plan(backend_name: str, plan: Plan) -> None:
    """Encode a plan as it is (tensors and bytes bound directly), through the same encoder as the ops."""
    device = "mps" if backend_name == "metal" else "cpu"
    launches = []
    for launch in plan.launches:
        buffers = []
        for i, b in sorted(launch.buffers.items()):
            if not isinstance(b, bytes):
                _check_device(launch.kernel, i, b, device)
                b = (_TENSOR, b, extent_bytes(b))
            buffers.append((i, b))
        launches.append((launch.source, launch.kernel, sorted(launch.function_constants.items()), buffers,
                         tuple(launch.threadgroups), tuple(launch.threadgroup),
                         sorted(launch.threadgroup_memory.items())))
    load().core.run_plan(backend_name, launches)


def _check_device(kernel: str, index: int, t, device: str) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != device:
        got = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise RuntimeError(f"torch_metal_flash: {kernel}: buffer {index} must be a{'n MPS' if device == 'mps' else ' CPU'}"
                           f" tensor or bytes, got {got}")


def plan_cache_info() -> dict:
    """``hits``, ``misses``, ``evictions``, ``size``, ``capacity`` and ``verify`` of the plan cache."""
    if _ext is None:
        return {"hits": 0, "misses": 0, "evictions": 0, "size": 0, "capacity": 0, "verify": False}
    return dict(_ext.core.plan_cache_info())


def plan_cache_clear(*, reset_counters: bool = True) -> None:
    """Drop every cached launch template (and, by default, zero the counters)."""
    if _ext is not None:
        _ext.core.plan_cache_clear()
        if reset_counters:
            _ext.core.plan_cache_configure(reset_counters=True)


def _plan_cache_entry() -> dict:
    info = plan_cache_info()
    return {**info, "maxsize": info["capacity"]}


caches.register("plan", _plan_cache_entry, lambda: plan_cache_clear(reset_counters=False))


def configure_plan_cache(capacity: Optional[int] = None, verify: Optional[bool] = None) -> None:
    """Set the cache's capacity (drops its templates) and/or verify mode (re-plan every hit
    and raise when the template differs; ``TORCH_METAL_FLASH_PLAN_CACHE_VERIFY``)."""
    load().core.plan_cache_configure(capacity=capacity, verify=verify)


def use_stub_encoder(stub: bool) -> None:
    """Replace the emulator encoder by one that encodes nothing, so that the host
    path alone can be timed (bench/overhead.py); ``False`` restores it."""
    load().core.use_stub_encoder(stub)


def run_counts(reset: bool = False) -> dict:
    """Plans each encoder ran (merged into :func:`torch_metal_flash.run_counts`)."""
    if _ext is None:
        return {}
    return {name: n for name, n in _ext.core.run_counts(reset).items() if n}



# ---------------------------------------------------------------------------
# Callbacks from C++.
# ---------------------------------------------------------------------------

def _index(op: CoreOp) -> int:
    return _INDEX[op.name]


def _device(args) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))


def _current_choice() -> Optional[str]:
    return backends._choice.get()


def _on_miss(index: int, encoder: str, args: tuple):
    op = _OPS[index]
    outputs = tuple(op.outputs(*args))
    # The stub encoder stands in for the emulator's: it plans as the emulator does.
    plan = op.plan(backends.instance("metal" if encoder == "metal" else "emulator"), args, outputs)
    if plan is None:
        return (2,)
    if isinstance(plan, Unsupported):
        return (1, plan.reason)
    return (0, outputs, *_template(plan, args, outputs))


def _reference(index: int, why: int, reason: str, args: tuple):
    if why == _WHY_ROUTE:
        chosen = backends.resolve(_device(args))  # warns once with the reason, or raises (strict, bad name)
        if chosen is not None:
            raise RuntimeError(f"torch_metal_flash core: backend {chosen.name!r} selected in Python but not in C++")
    elif why == _WHY_UNSUPPORTED:
        backends.fallback(reason)
    backends.record_run("reference")
    return tuple(_OPS[index].reference(*args))


def _debug_check(index: int, args: tuple) -> None:
    _OPS[index].debug_check(*args)


def _autograd(index: int, args: tuple):
    output = _AUTOGRAD[index](*args)
    return (output,) if isinstance(output, torch.Tensor) else output


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from a view's first to its last element (what a kernel may touch)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _place(t: torch.Tensor):
    return t.device, t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size()


def _template(plan: Plan, args: tuple, outputs: tuple):
    """(scratch, launches) of a plan, each bound tensor named by what it is."""
    named = [(_OUTPUT, i, t) for i, t in enumerate(outputs)] + \
            [(_ARG, i, t) for i, t in enumerate(args) if isinstance(t, torch.Tensor)] + \
            [(_SCRATCH, i, t) for i, t in enumerate(plan.scratch)]
    by_id = {}
    by_place = {}
    for kind, i, t in named:
        by_id.setdefault(id(t), (kind, i))
        if t.untyped_storage().data_ptr() != 0:
            by_place.setdefault(_place(t), (kind, i))
    device = outputs[0].device.type if outputs else _device(args).type
    launches = []
    for launch in plan.launches:
        buffers = []
        for index, b in sorted(launch.buffers.items()):
            if isinstance(b, bytes):
                buffers.append((index, b))
                continue
            _check_device(launch.kernel, index, b, device)
            ref = by_id.get(id(b))
            if ref is None and b.untyped_storage().data_ptr() != 0:
                ref = by_place.get(_place(b))
            if ref is None:
                raise RuntimeError(f"{launch.kernel}: buffer {index} is neither an argument of the op, an output nor "
                                   f"the plan's scratch; planners must not derive tensors "
                                   f"(see torch_metal_flash.planner.plan)")
            buffers.append((index, (ref[0], ref[1], extent_bytes(b))))
        launches.append((launch.source, launch.kernel, sorted(launch.function_constants.items()), buffers,
                         tuple(launch.threadgroups), tuple(launch.threadgroup),
                         sorted(launch.threadgroup_memory.items())))
    return list(plan.scratch), launches


def _emulator_prepare(source, kernel, constants, threadgroups, threadgroup, threadgroup_memory):
    return backends.instance("emulator").prepare(source, kernel, dict(constants), threadgroups, threadgroup,
                                                 dict(threadgroup_memory))


def _raw(b):
    if isinstance(b, bytes):
        return b
    address, nbytes = b
    return (ctypes.c_char * nbytes).from_address(address) if nbytes else b""


def _emulator_encode(launches) -> None:
    backends.instance("emulator").encode([(prepared, {i: _raw(b) for i, b in bound}) for prepared, bound in launches])
