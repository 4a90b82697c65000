"""Tuned kernels on every Mac: the variant space, forced variants, the tuner and its cache.

    tmf.tuning.variants("fwd", dtype=torch.float16, head_dim=128)   # kernel names, the default first
    with tmf.tuning.use("fwd", "flash_fwd_f16_d128_q64_k32"):       # force a variant (this thread)
        out = tmf.flash_attn_func(q, k, v, causal=True)
    tmf.tuning.choice("fwd", dtype=torch.float16, head_dim=128, seqlen_q=4096, seqlen_k=4096, causal=True)
    tmf.tuning.tune([{"op": "fwd", "dtype": torch.float16, "head_dim": 128, "seqlen_q": 4096,
                      "seqlen_k": 4096, "causal": True}])

The planners ask :func:`planned` for every part they tile (on a plan-cache miss
only: a host-side lookup, no device work); a forced variant wins, then the
cache's winner for the problem's class, then the family table.  The plan
cache keys on this thread's forced variants, the emulator's family setting
and the cache's contents.  See docs/tuning.md.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from . import cache as _cache
from .cache import TuningCacheWarning, feature_class, seq_class
from .space import OPS, PARTS, accepts, as_dtype, catalog, check_family, check_op, part_variants
from .stock import STOCK

__all__ = ["OPS", "STOCK", "variants", "use", "choice", "tune", "cache_path", "current_family",
           "TuningCacheWarning", "reload"]

FEATURES = ("mask", "dropout", "varlen")
DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def current_family() -> str:
    """The GPU family the current device plans with: the Metal backend's on a Mac, else the emulator's."""
    import torch_metal_flash.backends as backends
    if torch.backends.mps.is_available():
        import torch_metal_flash.backends.metal as metal
        if metal.unavailable_reason(torch.device("mps")) is None:
            return backends.instance("metal").family
    return backends.instance("emulator").family


def _family(family: Optional[str]) -> str:
    from ..planner.tiles import table_family
    return check_family(family) if family is not None else table_family(current_family())


def variants(op: str, *, dtype, head_dim: int, head_dim_v: Optional[int] = None,
             family: Optional[str] = None) -> list[str]:
    """The variant names (kernel host names) ``op`` may run for ``dtype`` and the head
    dims on ``family`` (default: the current device's), the family's default first; for
    ``"bwd"`` the dQ variants, then the dK/dV ones."""
    check_op(op)
    dtype, fam = as_dtype(dtype), _family(family)
    return [name for part in PARTS[op] for name in part_variants(op, part, dtype, head_dim, head_dim_v, fam)]


# ----------------------------------------------------------------------------- forced variants

_local = threading.local()


def _forced() -> dict:
    return getattr(_local, "forced", {})


@contextlib.contextmanager
def use(op: str, variant: str) -> Iterator[None]:
    """Force ``variant`` for the calls of ``op`` this thread makes inside (problems it
    applies to: its dtype and head-dim bucket; others keep their choice).  Nested uses
    force one variant per part (e.g. a dQ and a dK/dV kernel).  ``"torch"`` forces the
    stock route: the SDPA face and override call torch's own SDPA (the flash-attn faces
    keep the kernels)."""
    check_op(op)
    parts = catalog(op)
    if variant not in parts and variant != STOCK:
        raise ValueError(f"tuning.use: {variant!r} is not a variant of {op!r}; valid variants: "
                         f"{STOCK!r} (torch's own SDPA), {', '.join(sorted(parts))}")
    global _forcing_stock, _stock_hint
    import torch_metal_flash.core as core
    core.load()  # the plan cache keys on the forced variants from the first call on
    before = _forced()
    _local.forced = {**before, (op, parts.get(variant, "route")): variant}
    sync_thread()
    stock = variant == STOCK
    if stock:
        with _cache_lock:
            _forcing_stock += 1
            _stock_hint = None
    try:
        yield
    finally:
        _local.forced = before
        sync_thread()
        if stock:
            with _cache_lock:
                _forcing_stock -= 1
                _stock_hint = None


# ----------------------------------------------------------------------------- plan-cache keying

_tokens: dict = {(): 0}
_tokens_lock = threading.Lock()
_generation = 0


def _thread_state() -> tuple:
    import torch_metal_flash.emulator.config as config
    family = config.family_override()
    state = tuple(sorted(_forced().items()))
    return state + ((("emulator-family", family),) if family else ())


def sync_thread() -> None:
    """Tell the C++ plan cache which forced variants / emulator family this thread plans with."""
    import torch_metal_flash.core as core
    state = _thread_state()
    with _tokens_lock:
        token = _tokens.setdefault(state, len(_tokens))
    _local.token = token
    if core.loaded():
        core.load().core.set_thread_tuning(token)


def state_key() -> tuple:
    """What a choice made on the host depends on besides the problem: the cache's generation
    and this thread's token (forced variants or route, emulator family), as the plan cache keys."""
    return _generation, getattr(_local, "token", 0)


def _bump() -> None:
    """The cache's contents changed: plans made before may pick other variants."""
    global _generation, _stock_hint
    import torch_metal_flash.core as core
    _generation += 1
    _stock_hint = None
    if core.loaded():
        core.load().core.set_tuning_generation(_generation)


def sync_core(ext) -> None:
    """Called when the core loads: the current generation and this thread's state."""
    ext.core.set_tuning_generation(_generation)
    state = _thread_state()
    with _tokens_lock:
        token = _tokens.setdefault(state, len(_tokens))
    ext.core.set_thread_tuning(token)


# ----------------------------------------------------------------------------- the cache

_cache_lock = threading.Lock()
_loaded: Optional[_cache.Cache] = None


def cache_path(family: Optional[str] = None) -> Path:
    """The cache file this process reads and ``tune`` writes."""
    return _cache.default_path(_cache.gpu_name(_family(family)))


def _current_cache(family: str) -> _cache.Cache:
    global _loaded
    path, gpu = cache_path(family), _cache.gpu_name(family)
    c = _loaded
    if c is None or c.path != path or c.gpu != gpu:
        with _cache_lock:
            c = _loaded
            if c is None or c.path != path or c.gpu != gpu:
                # plans made so far saw the old file (none when this is the first load)
                changed = c is not None
                c = _loaded = _cache.Cache(path, gpu)
                if changed:
                    _bump()
    return c


def reload() -> None:
    """Read the cache file again (e.g. after another process tuned, or after
    ``TORCH_METAL_FLASH_TUNING_CACHE`` changed: plans already cached keep their
    choice until then)."""
    global _loaded
    with _cache_lock:
        _loaded = None
    _bump()


def _key(op, part, dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, features) -> tuple:
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise TypeError(f"tuning: unknown feature(s) {', '.join(sorted(unknown))}; known: {', '.join(FEATURES)}")
    hdv = head_dim if head_dim_v is None else head_dim_v
    return _cache.make_key(op, part, DTYPE_NAMES[dtype], head_dim, hdv, feature_class(bool(causal), features),
                           seq_class(seqlen_q, seqlen_k))


def planned(op: str, part: str, dtype: torch.dtype, head_dim: int, head_dim_v: Optional[int], *, family: str = None,
            seqlen_q: int, seqlen_k: int, causal: bool, features: dict) -> Optional[str]:
    """The variant a planner uses for ``part`` of ``op`` (None: the family table's)."""
    from ..planner.tiles import table_family
    fam = table_family(family or current_family())
    forced = _forced().get((op, part))
    if forced is not None and accepts(op, part, forced, dtype, head_dim, head_dim_v, fam):
        return forced
    key = _key(op, part, dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, features)
    entry = _current_cache(fam).get(key)
    if entry is None and autotune_enabled() and not any(features.values()):
        entry = _autotune(op, dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, fam, key)
    if entry is not None and accepts(op, part, entry["variant"], dtype, head_dim, head_dim_v, fam):
        return entry["variant"]
    return None


# ----------------------------------------------------------------------------- opt-in autotuning

AUTOTUNE_ENV = "TORCH_METAL_FLASH_AUTOTUNE"
AUTOTUNE_BUDGET_ENV = "TORCH_METAL_FLASH_AUTOTUNE_BUDGET"
AUTOTUNE_BUDGET = 2.0  # seconds of timing per problem class, default
_autotuned: set = set()
_autotune_lock = threading.Lock()


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "0").strip().lower() not in ("", "0", "false", "no", "off")


def autotune_budget() -> float:
    return float(os.environ.get(AUTOTUNE_BUDGET_ENV, "") or AUTOTUNE_BUDGET)


def budget_timer(budget: float, warmup: int = 1, repeats: int = 3) -> Callable:
    """:func:`gpu_timer` that stops timing once ``budget`` seconds have passed: the
    variants left are not run (they cannot win); the first (the default) and the stock
    route (``"torch"``, the baseline a class is routed to) always are."""
    timer, start = gpu_timer(warmup, repeats), time.perf_counter()
    first = [True]

    def timed(variant, run):
        if not first[0] and variant != STOCK and time.perf_counter() - start > budget:
            return float("inf")
        first[0] = False
        return timer(variant, run)
    return timed


def _autotune(op, dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, family, key) -> Optional[dict]:
    """Tune the class of a problem met for the first time (once per class and process; the
    problem's shape with one batch row and 8 heads; its timing budget per op part)."""
    if getattr(_local, "autotuning", False):
        return None  # the tuner's own calls
    with _autotune_lock:
        if key[:1] + key[2:] in _autotuned:
            return None
        _autotuned.add(key[:1] + key[2:])
    _local.autotuning = True
    try:
        tune([dict(op=op, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, seqlen_q=seqlen_q,
                   seqlen_k=seqlen_k, causal=causal, family=family)], timer=budget_timer(autotune_budget()))
    finally:
        _local.autotuning = False
    return _current_cache(family).get(key)


def choice(op: str, *, dtype, head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool,
           family: Optional[str] = None, head_dim_v: Optional[int] = None, part: Optional[str] = None,
           **features) -> tuple[str, str]:
    """``(variant, source)`` the planner would use for such a problem: source ``"tuned"``
    (the cache's winner), ``"default"`` (the family table) or ``"forced"`` (inside
    :func:`use`).  ``part`` picks the kernel of ``"bwd"`` (``"dq"``, the default, or
    ``"dkv"``); ``features``: ``mask``, ``dropout``, ``varlen`` (bools)."""
    check_op(op)
    dtype, fam = as_dtype(dtype), _family(family)
    part = part or PARTS[op][0]
    if part not in PARTS[op]:
        raise ValueError(f"tuning.choice: {op!r} has parts {', '.join(PARTS[op])}, got part={part!r}")
    names = part_variants(op, part, dtype, head_dim, head_dim_v, fam)
    if not names:
        raise ValueError(f"tuning.choice: no {op} kernel takes dtype {dtype}, head dims {head_dim}/{head_dim_v}")
    if _forced().get((op, "route")) == STOCK:
        return STOCK, "forced"
    forced = _forced().get((op, part))
    if forced is not None and accepts(op, part, forced, dtype, head_dim, head_dim_v, fam):
        return forced, "forced"
    entry = _current_cache(fam).get(_key(op, part, dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, features))
    if entry is not None and _stock_route(entry):
        return STOCK, "tuned"
    if entry is not None and accepts(op, part, entry["variant"], dtype, head_dim, head_dim_v, fam):
        return entry["variant"], "tuned"
    return names[0], "default"


def _stock_route(entry: dict) -> bool:
    stock = entry.get("stock")
    return isinstance(stock, dict) and stock.get("route") == STOCK


_stock_hint: Optional[bool] = None  # whether any call may take the stock route (None: to be worked out)
_forcing_stock = 0  # threads inside use(op, "torch")


def stock_possible() -> bool:
    """False when no call can take the stock route: no verdict for torch in this device's
    cache, no thread forcing it, no autotuning (the faces skip the lookup then: one flag)."""
    global _stock_hint
    hint = _stock_hint
    if hint is None:
        generation = _generation
        with _cache_lock:
            forcing = _forcing_stock > 0
        hint = forcing or any(_stock_route(e) for e in _current_cache(_family(None)).entries.values())
        if generation == _generation:  # else the cache changed meanwhile: work it out again next time
            _stock_hint = hint
    return hint or autotune_enabled()


def takes_torch(op: str, dtype: torch.dtype, head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int,
                causal: bool, features: dict) -> bool:
    """Whether a torch-semantics call of ``op``'s class goes to torch's own SDPA: forced with
    ``use(op, "torch")``, or the cache's verdict for the class (a forced kernel variant of
    ``op`` keeps the kernels).  A host-side lookup, no device work; the faces memoise it
    per call signature and :func:`state_key`."""
    forced = _forced()
    if forced.get((op, "route")) == STOCK:
        return True
    if any(o == op for o, part in forced if part != "route"):
        return False
    fam = _family(None)
    key = _key(op, PARTS[op][0], dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, features)
    entry = _current_cache(fam).get(key)
    if entry is None and autotune_enabled() and not any(features.values()):
        entry = _autotune(op, dtype, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, fam, key)
    return entry is not None and _stock_route(entry)


def tuned_entries(family: Optional[str] = None) -> list[dict]:
    """The cache's entries for this machine (the doctor lists them)."""
    return list(_current_cache(_family(family)).entries.values())


# ----------------------------------------------------------------------------- the tuner

def gpu_timer(warmup: int = 2, repeats: int = 7) -> Callable[[str, Callable[[], None]], float]:
    """``timer(variant, run)``: the median of ``repeats`` runs after ``warmup``, timed
    on the GPU with ``torch.mps.Event`` timestamps on MPS (host clock elsewhere)."""
    def timer(variant: str, run: Callable[[], None]) -> float:
        for _ in range(warmup):
            run()
        times = []
        mps = torch.backends.mps.is_available()
        for _ in range(repeats):
            if mps:
                start, end = torch.mps.Event(enable_timing=True), torch.mps.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return timer


def _runner(problem: dict, device: torch.device, forward_backward: bool = False) -> Callable[[], None]:
    """A closure that runs ``problem``'s op once on ``device``: the forward op (which takes
    the decode kernels for decode shapes), or the backward op alone (its forward run once
    here), or with ``forward_backward`` both (the stock route's comparison).  The ops are
    called directly: no autograd, so this also works inside a backward
    pass (autotuning) and times the kernels, not the faces."""
    op, dtype = problem["op"], as_dtype(problem["dtype"])
    B, H = int(problem.get("batch", 1)), int(problem.get("heads", 8))
    Hkv = int(problem.get("kv_heads", H))
    Lq, Lk, D = int(problem["seqlen_q"]), int(problem["seqlen_k"]), int(problem["head_dim"])
    Dv = int(problem.get("head_dim_v") or D)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g).to(dtype).to(device)
    causal = bool(problem["causal"])
    import torch_metal_flash.ops as ops
    # the bottom-right diagonal, causal or no window, no softcap
    scalars = dict(scale=D ** -0.5, diag_offset=Lk - Lq, window_left=-1, window_right=0 if causal else -1,
                   softcap=0.0)

    def forward(return_aux: bool):
        return ops.fwd_call(q=q, k=k, v=v, attn_mask=None, alibi_slopes=None, sinks=None, **scalars,
                            return_aux=return_aux)
    if op != "bwd":
        return lambda: forward(False)
    with torch.no_grad():
        out, _, aux = forward(True)
    dout = torch.randn(B, H, Lq, Dv, generator=g).to(dtype).to(device)

    def backward(out, aux):
        return ops.bwd_call(dout=dout, q=q, k=k, v=v, out=out, aux=aux, dlse=None, attn_mask=None, alibi_slopes=None,
                            sinks=None, **scalars, compute_dbias=False)
    if forward_backward:
        return lambda: backward(*forward(True)[::2])
    return lambda: backward(out, aux)


# Checks a variant's results on this machine before it is timed: (op, problem, device) -> None, or
# what differs.  torch_metal_flash._compose installs it (the oracle lives in torch_metal_flash.testing, a layer up).
_result_check: Optional[Callable[[str, dict, torch.device], Optional[str]]] = None


def install_result_check(check: Callable[[str, dict, torch.device], Optional[str]]) -> None:
    global _result_check
    _result_check = check


def tune(problems, *, timer: Optional[Callable] = None, cache=None, progress: Optional[Callable] = None,
         verify: bool = True, stock: bool = True) -> list:
    """Time every variant of every part of each problem, keep the fastest in the cache
    and return the choices: dicts with the problem, ``part``, ``variant`` (the winner),
    ``default``, ``seconds`` (variant -> seconds), ``speedup`` (default / winner) and
    ``stock`` (the stock route's verdict, below).

    ``problems``: dicts with ``op`` plus the keyword arguments of :func:`choice`
    (optionally ``batch``, ``heads`` and ``kv_heads``, default 1, 8 and ``heads``).  ``timer(variant, run)``
    returns the seconds of one run (default :func:`gpu_timer`); ``cache``: the file
    to update (default :func:`cache_path`).  ``progress(i, n, text)`` is told of each step.
    ``verify``: each variant first runs a small problem of the class against the float64
    oracle (:mod:`torch_metal_flash.testing.tuning_gate`); one that fails is not timed, never
    chosen, and listed in the result's ``rejected`` (variant -> what differs); ``variant`` is
    None when all fail.  ``stock``: also time torch's own SDPA on the problem (``timer("torch",
    run)``; forward + backward for ``"bwd"``, against our forward + backward with the winners,
    ``timer("kernels", run)``), measure both routes' peak memory and route the class to torch
    when :func:`torch_metal_flash.tuning.stock.verdict` says so: ``stock`` holds ``route``,
    ``why``, ``kernels_seconds``, ``torch_seconds``, ``kernels_peak_bytes``,
    ``torch_peak_bytes`` and ``working_set_bytes``."""
    timer = timer or gpu_timer()
    device = torch.device("mps") if torch.backends.mps.is_available() else torch.device("cpu")
    import torch_metal_flash.backends as backends
    backend_name = "metal" if device.type == "mps" else "emulator"
    steps = []
    here = _family(None)
    for index, problem in enumerate(problems):
        problem = dict(problem)
        op = check_op(problem.pop("op"))
        dtype, fam = as_dtype(problem["dtype"]), _family(problem.get("family"))
        if fam != here:
            raise ValueError(f"tuning.tune times this device, whose GPU family is {here}; a problem asks for "
                             f"family={fam!r}")
        features = {k: bool(problem[k]) for k in FEATURES if k in problem}
        for part in PARTS[op]:
            names = part_variants(op, part, dtype, problem["head_dim"], problem.get("head_dim_v"), fam)
            if names:
                steps.append((index, op, part, dtype, fam, features, problem, names))
    total = sum(len(s[-1]) for s in steps) + (len({s[0] for s in steps}) if stock else 0)
    done = 0
    results = []
    c = _cache.Cache(Path(cache), _cache.gpu_name(here)) if cache is not None else _current_cache(here)
    for i, (index, op, part, dtype, fam, features, problem, names) in enumerate(steps):
        run = _runner({**problem, "op": op}, device)
        seconds, rejected = {}, {}
        with backends.backend(backend_name, strict=True):
            for name in names:
                if progress is not None:
                    progress(done, total, f"{op}/{part} {name}")
                with use(op, name):
                    why = _result_check(op, problem, device) if verify and _result_check else None
                    if why is None:
                        seconds[name] = float(timer(name, run))
                    else:
                        rejected[name] = why
                done += 1
        timed = [n for n in names if n in seconds]
        if not timed:
            results.append({**problem, "op": op, "part": part, "family": fam, "variant": None, "default": names[0],
                            "seconds": {}, "speedup": 1.0, "rejected": rejected, "stock": None})
        else:
            winner = min(timed, key=lambda n: (seconds[n], names.index(n)))
            seconds = {n: s for n, s in seconds.items() if s != float("inf")}  # not timed (a time budget)
            key = _key(op, part, dtype, problem["head_dim"], problem.get("head_dim_v"), problem["seqlen_q"],
                       problem["seqlen_k"], problem["causal"], features)
            c.put(dict(zip(_cache._KEY, key), variant=winner, seconds=seconds))
            base = seconds.get(names[0])
            results.append({**problem, "op": op, "part": part, "family": fam, "variant": winner,
                            "default": names[0], "seconds": seconds, "rejected": rejected, "stock": None,
                            "speedup": base / seconds[winner] if base and seconds[winner] else 1.0})
        last_part = i + 1 == len(steps) or steps[i + 1][0] != index
        if stock and last_part:
            if progress is not None:
                progress(done, total, f"{op} torch's SDPA")
            mine = results[len(results) - sum(1 for s in steps if s[0] == index):]
            _time_stock(op, problem, mine, timer, device, backend_name, c, features)
            done += 1
    if progress is not None:
        progress(total, total, "done")
    c.save()
    reload()
    return results


def _time_stock(op, problem, mine, timer, device, backend_name, c, features) -> None:
    """Time torch's SDPA on a problem whose parts ``mine`` were tuned, record the verdict on
    their results and cache entries (the route of the class)."""
    import torch_metal_flash.backends as backends
    from . import stock
    if any(r["variant"] is None for r in mine):
        return  # no verified kernel to compare with: the class keeps the kernels' fallback
    forward = {**problem, "op": op}
    with contextlib.ExitStack() as stack:
        stack.enter_context(backends.backend(backend_name, strict=True))
        for r in mine:
            stack.enter_context(use(op, r["variant"]))
        if op == "bwd":
            ours = _runner(forward, device, forward_backward=True)
            kernels_seconds = float(timer("kernels", ours))
        else:
            ours = _runner(forward, device)
            kernels_seconds = mine[0]["seconds"][mine[0]["variant"]]
        kernels_peak = stock.peak_bytes(ours)
    torch_seconds, torch_peak, oom = stock.measure(timer, stock.torch_runner(forward, device, backward=op == "bwd"))
    working_set = stock.working_set_bytes(device)
    if torch_seconds is None:
        route, why = "kernels", oom
    else:
        route, why = stock.verdict(kernels_seconds, torch_seconds, torch_peak, working_set)
    verdict = {"route": route, "why": why, "kernels_seconds": kernels_seconds, "torch_seconds": torch_seconds,
               "kernels_peak_bytes": kernels_peak, "torch_peak_bytes": torch_peak, "working_set_bytes": working_set}
    for r in mine:
        r["stock"] = verdict
        key = _key(op, r["part"], as_dtype(problem["dtype"]), problem["head_dim"], problem.get("head_dim_v"),
                   problem["seqlen_q"], problem["seqlen_k"], problem["causal"], features)
        c.entries[key]["stock"] = verdict


# ----------------------------------------------------------------------------- callbacks (wired by torch_metal_flash._compose)

def _sync_family(_family: Optional[str]) -> None:
    # the plan cache keys on the family this thread plans with; its cache may hold other routes
    global _stock_hint
    _stock_hint = None
    import torch_metal_flash.core as core
    core.load()
    sync_thread()
