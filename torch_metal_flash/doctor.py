"""``python -m torch_metal_flash doctor``: check this machine, end to end.

The first command to run after installing, and what to paste into a bug report:

1. the machine: chip, macOS, torch, the backend and why, GPU family, whether
   the neural-accelerator path is active (or why not), Metal language version,
   math mode, what the install built;
2. every pipeline the planners can emit, compiled (``planner/variants.py``:
   every kernel of the tile tables, each function-constant value at least once;
   ``--all-variants`` for every combination), with the limits each reports;
3. a probe grid -- forward, backward, decode, FlexAttention (a generated
   kernel: document mask, learned relative bias); fp32/fp16/bf16; several head
   dims; masks, GQA, windows, softcap -- run in strict mode and held to the
   float64 oracle by the acceptance rule (torch_metal_flash/testing/oracle.py);
4. timing of forward, forward+backward and decode against
   ``F.scaled_dot_product_attention``;
5. a markdown report; the exit status is 1 when anything failed.

On a Mac with MPS it runs the Metal kernels; elsewhere the same kernels in the
emulator, on a reduced grid (so CI runs it too).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import platform
import sys
import time
import traceback
from typing import Optional

import torch
import torch.nn.functional as F

import torch_metal_flash as tmf

import torch_metal_flash.backends as backends
import torch_metal_flash.native as native
import torch_metal_flash.ops as ops
import torch_metal_flash.progress as progress
from ._paths import build_info, is_nax_source
import torch_metal_flash.backends.metal as metal
import torch_metal_flash.planner.variants as variants
from .problem.spec import make_spec
from .testing import error_budget, forward_reference, grad_errors, inject_faults, randn

MIN_MACOS = (14, 0)  # MSL 3.1 (bfloat) and torch's MPS backend
SECTIONS = ("compile", "probes", "faults", "timing")
MAX_LISTED = 10  # compile failures listed per shader file


@dataclasses.dataclass(frozen=True)
class Probe:
    kind: str  # "forward" | "backward" | "decode" | "flex"
    dtype: torch.dtype
    dims: tuple  # (B, Hq, Hkv, Lq, Lk, D)
    causal: bool = False  # bottom-right aligned, as flash-attn
    window: tuple = (-1, -1)
    mask: str = ""  # "" | "bool" | "float"
    softcap: float = 0.0
    dv: int = 0  # v's head dim when it differs from D (latent attention: 512 under 576)

    @property
    def name(self) -> str:
        B, Hq, Hkv, Lq, Lk, D = self.dims
        feats = [f for f, on in (("causal", self.causal), (f"window {self.window}", self.window != (-1, -1)),
                                 (f"{self.mask} mask", self.mask), (f"softcap {self.softcap:g}", self.softcap),
                                 (f"GQA {Hq}:{Hkv}", Hq != Hkv)) if on]
        return (f"{self.kind} {str(self.dtype)[6:]} B{B} Lq{Lq} Lk{Lk} d{D}" + (f"/{self.dv}" if self.dv else "")
                + (f" ({', '.join(feats)})" if feats else ""))


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def probe_grid(full: bool) -> list[Probe]:
    """The probes: on a GPU every dtype x head dim x feature set; in the emulator a few."""
    if not full:
        return [Probe("forward", torch.float16, (1, 4, 2, 37, 129, 64), causal=True),
                Probe("forward", torch.bfloat16, (1, 2, 2, 33, 47, 72), mask="float", window=(16, 8)),
                Probe("forward", torch.float32, (2, 2, 2, 20, 20, 32), mask="bool", softcap=20.0),
                Probe("backward", torch.float32, (1, 2, 1, 17, 23, 32), causal=True),
                Probe("backward", torch.float16, (1, 2, 2, 20, 20, 64), mask="float"),
                Probe("decode", torch.float16, (2, 8, 2, 1, 300, 64), causal=True),
                Probe("decode", torch.float16, (1, 16, 1, 2, 300, 576), causal=True, dv=512),
                Probe("flex", torch.float16, (1, 2, 1, 67, 90, 64))]
    grid = []
    for dtype in DTYPES:
        for D in (32, 64, 96, 128, 256, 512):
            grid += [Probe("forward", dtype, (2, 8, 8, 257, 257, D), causal=True),
                     Probe("forward", dtype, (1, 8, 2, 113, 203, D), causal=True),
                     Probe("forward", dtype, (1, 4, 4, 255, 1000, D), window=(64, 0), softcap=30.0),
                     Probe("forward", dtype, (2, 4, 4, 127, 129, D), mask="float"),
                     Probe("forward", dtype, (1, 4, 1, 129, 127, D), mask="bool")]
        for D in (64, 128, 256, 512):
            grid += [Probe("backward", dtype, (1, 8, 2, 113, 203, D), causal=True),
                     Probe("backward", dtype, (2, 4, 4, 127, 129, D), mask="float", window=(32, 32))]
        for D in (64, 128):
            grid += [Probe("decode", dtype, (4, 32, 8, 1, 1000, D), causal=True),
                     Probe("decode", dtype, (2, 16, 2, 4, 4096, D), causal=True, window=(512, 0))]
        grid += [Probe("decode", dtype, (1, 16, 1, Lq, 4096, 576), causal=True, dv=512) for Lq in (1, 4)]
        grid += [Probe("flex", dtype, (1, 4, 2, 257, 300, D)) for D in (64, 128)]
    return grid


# ---------------------------------------------------------------------------
# The machine.
# ---------------------------------------------------------------------------

def _macos() -> Optional[tuple]:
    release = platform.mac_ver()[0]
    return tuple(int(x) for x in release.split(".")[:2]) if release else None


def choose_backend(name: str):
    """(name, backend, device, why): the metal backend on a working Mac, else the emulator."""
    if name in ("auto", "metal"):
        with tmf.backend("metal"):
            chosen, why = backends.select(torch.device("mps"))
        if chosen is not None and torch.backends.mps.is_available():
            return "metal", chosen, torch.device("mps"), "the Metal kernels on the MPS stream"
        if name == "metal":
            return "metal", None, torch.device("mps"), why or "torch reports no usable MPS device"
    with tmf.backend("emulator"):
        chosen, why = backends.select(torch.device("cpu"))
    import torch_metal_flash.emulator as emulator
    try:
        compiler = emulator.find_compiler().ident
    except emulator.CompilerNotFoundError as exc:
        return "emulator", None, torch.device("cpu"), str(exc)
    return "emulator", chosen, torch.device("cpu"), f"the Metal kernels in the CPU emulator ({compiler})"


def machine_rows(name, backend, why) -> tuple[list, list]:
    """(rows of the machine table, failures)."""
    failures = []
    mac = _macos()
    system = f"macOS {platform.mac_ver()[0]}" if mac else platform.platform()
    if mac and mac < MIN_MACOS:
        failures.append(f"macOS {platform.mac_ver()[0]}: torch_metal_flash needs macOS 14 or newer "
                        "(Metal Shading Language 3.1 for bfloat; torch's MPS backend)")
    rows = [("torch_metal_flash", f"{tmf.__version__} ({os.path.dirname(tmf.__file__)})"),
            ("machine", f"{system}, {metal.chip_name()}"),
            ("python / torch", f"{platform.python_version()} / {torch.__version__} (MPS built: "
                               f"{torch.backends.mps.is_built()}, available: {torch.backends.mps.is_available()})"),
            ("backend", f"{name}: {why}")]
    if name == "metal" and backend is not None:
        family = backend.family if backend.family == backend.hardware_family else \
            f"{backend.family} (the GPU is {backend.hardware_family}; without the neural-accelerator path it " \
            f"plans as {backend.family})"
        rows += [("GPU family", family), ("Metal language", f"MSL {native.launcher().LANGUAGE_VERSION}")]
    elif name == "emulator":
        import torch_metal_flash.emulator as emulator
        checks = "race and bounds checks" if emulator.default_checked() else "fast mode, no checks"
        rows += [("GPU family", f"{backend.family} (the emulator plans as this family; "
                                f"emulator.settings(family=...) changes it)" if backend is not None else "apple8"),
                 ("Metal language", f"MSL 3.1 as C++20 (emulated; {checks})")]
    if backend is not None:
        rows.append(("neural accelerators", neural_accelerators(backend)))
    if sys.platform == "darwin" or name == "metal":
        rows.append(("Metal launcher", metal.unavailable_reason() or f"torch_metal_flash._C loaded from "
                                       f"{native.launcher().__file__} (torch {torch.__version__})"))
    info = build_info()
    if info:
        lib = info.get("metallib")
        if isinstance(lib, dict):
            nax = lib.get("nax")
            if isinstance(nax, dict) and nax["files"]:
                nax = f"; {', '.join(nax['files'])} ({nax['std']}, macOS {nax['macos_min']}+)"
            else:
                nax = f"; *_nax.metal {nax}" if isinstance(nax, str) else ""
            lib = f"{', '.join(lib['files'])} ({lib['std']}, macOS {lib['macos_min']}+, {lib['math_mode']} math; "\
                  f"{lib['compiler']}){nax}"
        against = f" against torch {info['torch']}" if info.get("torch") else ""
        ext = "built" if info.get("extension") is True else info.get("extension")
        rows.append(("install", f"built on {info.get('platform')}{against}; _C: {ext}; precompiled shaders: {lib}"))
    else:
        rows.append(("install", "a source checkout (no build record)"))
    return rows, failures


def neural_accelerators(backend) -> str:
    """Whether the neural-accelerator path (the apple10 tables, MSL 4.0 ``*_nax.metal`` kernels) is active, or why not."""
    why = backend.neural_accelerators_reason
    return f"inactive: {why}" if why else "active (apple10 tables; *_nax.metal kernels compiled as MSL 4.0)"


TUNING_PROBLEMS = [(op, dtype, d, lq, lk) for op in ("fwd", "bwd") for dtype in (torch.float16, torch.bfloat16)
                   for d in (64, 128) for lq, lk in ((1024, 1024), (4096, 4096))] + \
                  [("decode", torch.float16, d, 1, 4096) for d in (64, 128)]


def tuning_rows(family: str) -> tuple[str, list]:
    """(whether this machine is tuned, the choices in force for common problems)."""
    import torch_metal_flash.tuning as tuning
    from .planner.tiles import table_family
    family = table_family(family)
    entries = tuning.tuned_entries(family)
    path = tuning.cache_path(family)
    auto = "; TORCH_METAL_FLASH_AUTOTUNE=1: new problem classes are tuned when first met" \
        if tuning.autotune_enabled() else ""
    tuned = (f"tuned: {len(entries)} choices measured on this machine in {path}" if entries else
             f"not tuned: the {family} defaults (docs/tuning.md); `python -m torch_metal_flash tune` "
             f"writes {path}") + auto
    rows = []
    for op, dtype, d, lq, lk in TUNING_PROBLEMS:
        for part in tuning.PARTS[op]:
            variant, source = tuning.choice(op, dtype=dtype, head_dim=d, seqlen_q=lq, seqlen_k=lk, causal=True,
                                            family=family, part=part)
            rows.append((op, part, str(dtype)[6:], d, f"{lq} x {lk}", True, variant, source))
    return tuned, rows


def math_mode(name, backend) -> str:
    if name == "metal" and backend is not None:
        return native.launcher().math_mode()
    import torch_metal_flash.emulator as emulator
    mode = getattr(emulator, "math_mode", None)
    return mode() if callable(mode) else "the host CPU's IEEE float math (emulated)"


# ---------------------------------------------------------------------------
# Pipelines.
# ---------------------------------------------------------------------------

def compile_pipelines(backend, all_variants: bool, out=print) -> tuple[list, list, list]:
    """Compile every variant; (table rows, notes, failures)."""
    chosen = list(variants.all_variants()) if all_variants else variants.covering_variants()
    planned = variants.planned_threads()
    by_source = collections.defaultdict(list)
    for v in chosen:
        by_source[v.source].append(v)
    rows, notes, failures = [], [], []
    with progress.bar(len(chosen), "doctor: compiling pipelines", "pipeline") as bar:
        for source, group in by_source.items():
            _compile_source(backend, source, group, planned, rows, notes, failures, out, bar)
    return rows, notes, failures


def _compile_source(backend, source, group, planned, rows, notes, failures, out, bar) -> None:
    """Compile one shader file's pipelines, adding its row, notes and failures."""
    inactive = is_nax_source(source) and backend.neural_accelerators_reason
    if inactive:  # the backend refuses to compile these here
        rows.append((source, len(group), 0, f"- (not compiled: neural accelerators inactive: {inactive})", "-"))
        out(f"  {source}: {len(group)} pipelines not compiled (neural accelerators inactive)")
        bar.update(len(group))
        return
    start = time.perf_counter()
    failed, lowest, below = 0, None, set()
    for v in group:
        bar.update(1, v.kernel)
        try:
            info = backend.pipeline_info(v.source, v.kernel, v.constants)
        except Exception as exc:  # noqa: BLE001 -- every failure is reported, none stops the others
            failed += 1
            if failed <= MAX_LISTED:
                failures.append(f"compile {v.kernel} {v.constants}: {type(exc).__name__}: {exc}")
            continue
        limit = info["max_total_threads_per_threadgroup"]
        if lowest is None or limit < lowest[0]:
            lowest = (limit, v.kernel)
        if limit < planned[v.kernel]:
            below.add(f"{v.kernel} ({limit} < {planned[v.kernel]})")
    seconds = time.perf_counter() - start
    if failed > MAX_LISTED:
        failures.append(f"compile: {failed - MAX_LISTED} more pipelines of {source} failed")
    low = f"{lowest[0]} ({lowest[1]})" if lowest else "-"
    rows.append((source, len(group), failed, low, f"{seconds:.1f}"))
    out(f"  {source}: {len(group)} pipelines, {failed} failed, {seconds:.1f} s")
    if below:
        notes.append(f"{source}: pipelines allowing fewer threads than their tile plans (the planner takes "
                     f"another variant for these): {', '.join(sorted(below))}")


# ---------------------------------------------------------------------------
# Probes.
# ---------------------------------------------------------------------------

def _inputs(p: Probe, device, seed: int):
    """q, k, v as (B, H, L, D) views of (B, L, H, D) tensors (flash-attn layout, no copies), on ``device``."""
    B, Hq, Hkv, Lq, Lk, D = p.dims
    g = torch.Generator().manual_seed(seed)
    q, k, v = (randn(B, L, H, d, generator=g).to(p.dtype).to(device).transpose(1, 2)
               for L, H, d in ((Lq, Hq, D), (Lk, Hkv, D), (Lk, Hkv, p.dv or D)))
    mask = None
    if p.mask == "float":
        mask = randn(1, Hq, Lq, Lk, generator=g).to(p.dtype).to(device)
    elif p.mask == "bool":
        mask = (torch.rand(B, 1, Lq, Lk, generator=g) > 0.2).to(device)
    return q, k, v, mask, g


def _op_args(p: Probe, q, k, v, mask) -> dict:
    """The fwd op's arguments of a probe, by name."""
    Lq, Lk, D = p.dims[3], p.dims[4], p.dims[5]
    return dict(q=q, k=k, v=v, attn_mask=mask, alibi_slopes=None, sinks=None, scale=D ** -0.5,
                diag_offset=Lk - Lq if p.causal else 0, window_left=p.window[0],
                window_right=0 if p.causal else p.window[1], softcap=p.softcap)


def _spec_of(args: dict):
    a = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    return make_spec(a["q"], a["k"], a["v"], a["attn_mask"], a["alibi_slopes"], a["sinks"], scale=a["scale"],
                     diag_offset=a["diag_offset"], window_left=a["window_left"], window_right=a["window_right"],
                     softcap=a["softcap"])


def run_probe(p: Probe, name: str, device, seed: int) -> list[tuple[str, float, float]]:
    """(output, error, allowed) rows; raises when the kernels did not run."""
    q, k, v, mask, g = _inputs(p, device, seed)
    if p.kind == "flex":
        return _flex_probe(p, name, q, k, v, g)
    with tmf.backend(name, strict=True):
        if p.kind == "decode":
            B, Hq, Hkv, Lq, Lk, D = p.dims
            extra = 64  # cache slots past the filled length
            kc, vc = (torch.cat([t.transpose(1, 2), randn(B, extra, Hkv, t.shape[-1], generator=g).to(p.dtype)
                                 .to(device)], dim=1) for t in (k, v))
            out, lse = tmf.flash_attn_with_kvcache(
                q.transpose(1, 2), kc, vc, cache_seqlens=torch.full((B,), Lk, dtype=torch.int32, device=device),
                causal=p.causal, window_size=p.window, softcap=p.softcap, return_softmax_lse=True)
            out = out.transpose(1, 2)
            spec = make_spec(q, k, v, scale=D ** -0.5, diag_offset=Lk - Lq, window_left=p.window[0],
                             window_right=0 if p.causal else p.window[1], softcap=p.softcap)
        elif p.kind == "forward":
            args = _op_args(p, q, k, v, mask)
            out, lse, _ = ops.fwd_call(**args, return_aux=False)
            spec = _spec_of(args)
        else:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            args = _op_args(p, q, k, v, mask)
            out, lse, _ = ops.fwd_call(**args, return_aux=True)
            dout = randn(out.shape, generator=g).to(p.dtype).to(device)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            spec = _spec_of(args)
            return [(n, *e) for n, e in grad_errors(spec, dout, None, (*grads, None, None)).items()]
    if device.type == "mps":
        torch.mps.synchronize()
    ref, low = forward_reference(spec)
    return [(n, *error_budget(n, got, getattr(ref, n), getattr(low, n), ref.magnitude[n], p.dtype))
            for n, got in (("out", out), ("lse", lse))]


def _flex_probe(p: Probe, name: str, q, k, v, g) -> list[tuple[str, float, float]]:
    """FlexAttention forward and backward: a document + causal BlockMask and a learned relative
    bias (a source generated from the mods, its gradient summed along diagonals by the kernels)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from .testing.flex_oracle import FlexMods, flex_errors, flex_reference
    B, Hq, Hkv, Lq, Lk, D = p.dims
    device = q.device
    docs = (torch.arange(max(Lq, Lk), device=device) >= max(Lq, Lk) // 3).to(torch.int32)
    bias = (0.5 * randn(Hq, Lq + Lk - 1, generator=g)).to(device).requires_grad_()
    mods = FlexMods(score=lambda d, t: (lambda s, b, h, qi, kv: s + t[h, qi - kv + Lk - 1]),
                    mask=lambda d, t: (lambda b, h, qi, kv: (d[qi] == d[kv]) & (qi + Lk - Lq >= kv)),
                    captured=(docs, bias))
    score_mod, mask_mod = mods.build()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with tmf.backend(name, strict=True):
        block_mask = create_block_mask(mask_mod, 1, 1, Lq, Lk, device=device)
        out, lse = tmf.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=Hq != Hkv, return_lse=True)
        dout = randn(out.shape, generator=g).to(p.dtype).to(device)
        dq, dk, dv, dbias = torch.autograd.grad(out, (q, k, v, bias), dout)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dcaptured": [None, dbias]}
    return [(n, *e) for n, e in flex_errors(q, mods, got, flex_reference(q, k, v, mods, None, dout)).items()]


def run_probes(grid, name, device, out=print) -> tuple[list, list]:
    rows, failures = [], []
    for i, p in enumerate(grid):
        start = time.perf_counter()
        try:
            checks = run_probe(p, name, device, seed=1000 + i)
            worst = max(checks, key=lambda c: c[1] / c[2] if c[2] else float("inf"))
            ok = all(err <= allowed for _, err, allowed in checks)
            detail = f"{worst[0]} {worst[1]:.2e} / {worst[2]:.2e}"
        except Exception as exc:  # noqa: BLE001 -- a failing probe is a result, not the end of the run
            ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if not isinstance(exc, (AssertionError, tmf.UnsupportedError)):
                detail += f" [{traceback.extract_tb(exc.__traceback__)[-1].name}]"
        seconds = time.perf_counter() - start
        rows.append((p.name, detail, "ok" if ok else "FAIL", f"{seconds:.2f}"))
        if not ok:
            failures.append(f"probe {p.name}: {detail}")
        out(f"  {'ok  ' if ok else 'FAIL'} {p.name}: {detail} ({seconds:.2f} s)")
    return rows, failures


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------

def check_fault_fallback(name: str, device) -> tuple[list, list]:
    """A forward kernel that fails to compile and a backward kernel whose pipeline fails to build
    (testing.inject_faults), as a compiler that rejects them would: each call must fall back to the
    reference path with a warning naming the kernel and give its results, and the kernels must run
    again afterwards."""
    import warnings

    g = torch.Generator().manual_seed(11)
    q, k, v = (randn(1, 2, 64, 64, generator=g).to(device).requires_grad_() for _ in range(3))
    rows, failures = [], []
    with tmf.backend("reference"):
        out_ref = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads_ref = torch.autograd.grad(out_ref.sum(), (q, k, v))
    for stage, pattern in (("compile", "flash_fwd_"), ("pipeline", "flash_bwd_")):
        with warnings.catch_warnings(record=True) as record, tmf.backend(name):
            warnings.simplefilter("always")
            with inject_faults(**{stage: pattern}) as fault:
                out = tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
                grads = torch.autograd.grad(out.sum(), (q, k, v))
        said = [str(w.message) for w in record if issubclass(w.category, backends.FallbackWarning)]
        same = torch.allclose(out, out_ref, atol=1e-5, rtol=1e-4) and all(
            torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(grads, grads_ref))
        ok = fault.fired > 0 and len(said) == 1 and pattern in said[0] and same
        rows.append((f"{stage} fault in {pattern}* kernels", said[0].split(": ", 2)[-1] if said else "no warning",
                     "ok" if ok else "FAIL"))
        if not ok:
            failures.append(f"an injected {stage} fault in {pattern}* did not fall back as it should "
                            f"(fired {fault.fired}, warnings {said}, results {'equal' if same else 'differ'})")
    before = tmf.run_counts().get(name, 0)
    with tmf.backend(name):
        tmf.scaled_dot_product_attention(q, k, v, is_causal=True)
    again = tmf.run_counts().get(name, 0) > before
    rows.append(("after the faults", f"the {name} kernels run again" if again else "still on the reference path",
                 "ok" if again else "FAIL"))
    if not again:
        failures.append(f"after the injected faults the {name} kernels did not run again")
    return rows, failures


def _ms(fn, device, iters: int) -> float:
    fn()
    if device.type == "mps":
        torch.mps.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "mps":
        torch.mps.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def _kernel_names(op: str, q, v, causal: bool) -> str:
    """The kernels in force for the class (forced, tuned or the family's default), even where it is routed to torch."""
    import torch_metal_flash.tuning as tuning
    names = []
    for part in tuning.PARTS[op]:
        dims = dict(dtype=q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1])
        name = tuning.planned(op, part, dims["dtype"], dims["head_dim"], dims["head_dim_v"], seqlen_q=q.shape[-2],
                              seqlen_k=v.shape[-2], causal=causal, features={})
        names.append(name or tuning.space.part_variants(op, part, dims["dtype"], dims["head_dim"],
                                                        dims["head_dim_v"], tuning._family(None))[0])
    return " + ".join(names)


def run_timing(name, device, full: bool, out=print) -> tuple[list, list]:
    """(rows, failures): per case our kernels against F.scaled_dot_product_attention, as
    ``tune``'s table (tune.py ROUTE_HEADER): ms, speed-up, peak memory of each, the route."""
    import torch_metal_flash.faces.stock as face_stock
    from torch_metal_flash.faces.functional import kernels_sdpa
    import torch_metal_flash.tune as cli
    import torch_metal_flash.tuning.stock as stock
    dtype = torch.float16
    sizes = [(1, 16, 16, 1024, 1024, 64), (1, 16, 16, 4096, 4096, 64), (1, 16, 16, 2048, 2048, 128)] if full \
        else [(1, 2, 2, 64, 64, 32)]
    decode = (4, 32, 8, 1, 4096, 128) if full else (1, 4, 1, 1, 256, 32)
    iters = 20 if full else 1
    rows, failures = [], []
    cases = [("forward", s) for s in sizes] + [("forward+backward", s) for s in sizes] + [("decode", decode)]
    for kind, (B, Hq, Hkv, Lq, Lk, D) in cases:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(dtype).to(device)
                   .requires_grad_(kind == "forward+backward") for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv)))
        causal = kind != "decode"  # a decode step sees the whole cache

        def call(fn):
            if kind == "forward+backward":
                return lambda: torch.autograd.grad(fn(q, k, v, is_causal=causal, enable_gqa=True).sum(), (q, k, v))
            return lambda: fn(q, k, v, is_causal=causal, enable_gqa=True)
        label = f"{kind} B{B} H{Hq}/{Hkv} Lq{Lq} Lk{Lk} d{D} fp16"
        try:
            with tmf.backend(name, strict=True):
                op, _ = face_stock.op_class(q, k, v, None, 0.0, causal)
                kernels = _kernel_names(op, q, v, causal)
                route = "torch" if face_stock.takes_torch(None, q, k, v, None, 0.0, causal) else "kernels"
                ours = _ms(call(kernels_sdpa), device, iters)
                ours_peak = stock.peak_bytes(call(kernels_sdpa))
            theirs = _ms(call(F.scaled_dot_product_attention), device, iters)
            theirs_peak = stock.peak_bytes(call(F.scaled_dot_product_attention))
        except Exception as exc:  # noqa: BLE001
            failures.append(f"timing {label}: {type(exc).__name__}: {exc}")
            rows.append((label, "error") + ("",) * (len(TIMING_HEADER) - 2))
            continue
        rows.append((label, kernels, f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}x",
                     cli.size(ours_peak), cli.size(theirs_peak), route))
        out(f"  {label}: {ours:.3f} ms (torch {theirs:.3f} ms), route: {route}")
    return rows, failures


TIMING_HEADER = ("case", "kernel in force", "kernel ms", "torch ms", "speed-up (torch ms / kernel ms)",
                 "kernel peak", "torch peak", "route")


# ---------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------

def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_metal_flash doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("auto", "metal", "emulator"), default="auto")
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument("--quick", action="store_true", help="the reduced probe grid (the emulator's default)")
    grid.add_argument("--full", action="store_true", help="the full probe grid (the GPU's default)")
    parser.add_argument("--all-variants", action="store_true",
                        help="compile every function-constant combination (tens of thousands of pipelines)")
    parser.add_argument("--skip", default="", help=f"comma-separated sections to skip: {', '.join(SECTIONS)}")
    parser.add_argument("--report", help="also write the markdown report to this file")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(SECTIONS):
        parser.error(f"--skip takes {', '.join(SECTIONS)}; got {', '.join(sorted(skip - set(SECTIONS)))}")

    name, backend, device, why = choose_backend(args.backend)
    full = args.full or (name == "metal" and not args.quick)
    print(f"torch_metal_flash doctor: {name} backend, {'full' if full else 'reduced'} grid")
    machine, failures = machine_rows(name, backend, why)
    if args.backend == "auto" and name != "metal" and torch.backends.mps.is_available():
        failures.append(f"MPS is available but the Metal kernels cannot run: {metal.unavailable_reason()}")
    sections = []
    if backend is None:
        failures.append(f"no {name} backend: {why}")
    else:
        if "compile" not in skip:
            print("compiling pipelines ...")
            rows, notes, fails = compile_pipelines(backend, args.all_variants)
            failures += fails
            sections.append("## Pipelines\n\n" + _table(
                ("shader", "pipelines", "failed", "lowest maxTotalThreadsPerThreadgroup", "seconds"), rows)
                + "".join(f"\n\n{n}" for n in notes))
        if "probes" not in skip:
            print("probes ...")
            rows, fails = run_probes(probe_grid(full), name, device)
            failures += fails
            sections.append("## Probes (acceptance rule, torch_metal_flash.testing: max|x - ref64| <= 2 max|lowp - ref64| + atol)\n\n"
                            + _table(("probe", "worst: error / allowed", "result", "seconds"), rows))
        if "faults" not in skip:
            print("faults ...")
            rows, fails = check_fault_fallback(name, device)
            failures += fails
            sections.append("## Kernel faults (testing.inject_faults: the fallback when a kernel cannot be built)\n\n"
                            + _table(("injected", "what the call said", "result"), rows))
        if "timing" not in skip:
            print("timing ...")
            rows, fails = run_timing(name, device, full)
            failures += fails
            note = "" if name == "metal" else "\n\nThe emulator runs on the CPU: these times say nothing about a GPU."
            sections.append("## Timing (ms per call): the kernels against F.scaled_dot_product_attention, and the "
                            "route each class takes (docs/tuning.md)\n\n" + _table(TIMING_HEADER, rows) + note)
    machine.append(("math mode", math_mode(name, backend)))
    try:
        tuned, rows = tuning_rows(backend.family) if backend is not None else (None, [])
    except ValueError as exc:  # a GPU family without kernels: reported by the sections above
        tuned, rows = f"none ({exc})", []
    if tuned is not None:
        machine.append(("tuning", tuned))
    if rows:
        sections.append("## Tuning (the kernel variants in force)\n\n" + _table(
            ("op", "part", "dtype", "head dim", "L_q x L_k", "causal", "variant", "source"), rows))
    verdict = ("**PASS**" if not failures else
               f"**FAIL** ({len(failures)})\n\n" + "\n".join(f"- {f}" for f in failures))
    report = "\n\n".join(["# torch_metal_flash doctor", _table(("", ""), machine), *sections,
                          "## Result\n\n" + verdict]) + "\n"
    print("\n" + report)
    if args.report:
        with open(args.report, "w") as f:
            f.write(report)
    return 1 if failures else 0
