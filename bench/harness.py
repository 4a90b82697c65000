"""What the bench scripts share: the checkout they measure, where results go, the kernel
sweeps' flags and loop, a timing loop, allocator peaks and markdown rows.

Scripts run as ``python bench/<name>.py`` (so bench/ is on sys.path) and ``import harness``
first: that makes this checkout's torch_metal_flash the one they import, and the tests' shared
case matrices and oracles importable (``from support import forward_cases``).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def use_checkout(root: Path = ROOT) -> None:
    """Put ``root`` first on sys.path, so that its torch_metal_flash is the one imported."""
    path = str(Path(root).resolve())
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)


use_checkout()
# the case matrices and oracles the benches share with the tests: tests/support, imported as `support`
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(1, str(ROOT / "tests"))


def parser(doc: str, *, results: bool = False, json_summary: bool = False) -> argparse.ArgumentParser:
    """An argument parser described by a script's docstring; ``results`` adds ``--results DIR``
    (the folder of its markdown, default bench/results), ``json_summary`` adds ``--json``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if results:
        ap.add_argument("--results", default=str(RESULTS), help="folder of the markdown (default: bench/results)")
    if json_summary:
        ap.add_argument("--json", action="store_true", help="print the JSON summary as the last line")
    return ap


def sweep_parser(doc: str) -> argparse.ArgumentParser:
    """The flags of a kernel sweep (bench/sweep_forward.py, bench/sweep_backward.py)."""
    ap = parser(doc)
    ap.add_argument("--sample", type=int, default=0, help="run N sampled cases instead of the full matrix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every-combination", action="store_true")
    ap.add_argument("--shard", default="0/1", help="i/n: run every n-th case starting at i")
    ap.add_argument("--max-elems", type=int, default=0,
                    help="skip cases with B*Hq*Lq*Lk above this (0 = no limit)")
    ap.add_argument("--orders", default="forward,reverse")
    ap.add_argument("--unchecked", action="store_true", help="run without the race/bounds checks")
    ap.add_argument("--stop-on-fail", action="store_true")
    return ap


def sweep(cases, run_and_check, case_id, args) -> int:
    """``run_and_check(case, orders=..., checked=...)`` on the shard's cases of ``args``
    (:func:`sweep_parser`): a line per case, a summary and the failed cases; 1 if any failed."""
    shard_i, shard_n = (int(x) for x in args.shard.split("/"))
    orders = tuple(args.orders.split(","))
    n_ok = n_skip = 0
    failures = []
    t_start = time.time()
    for idx, case in enumerate(cases):
        if idx % shard_n != shard_i:
            continue
        if args.max_elems and case.get("batch", 1) * case["hq"] * case["lq"] * case["lk"] > args.max_elems:
            n_skip += 1
            continue
        t0 = time.time()
        try:
            run_and_check(case, orders=orders, checked=not args.unchecked)
            status = "ok"
            n_ok += 1
        except Exception as e:  # noqa: BLE001 - report every failure and go on
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            failures.append(case_id(case))
            if args.stop_on_fail:
                traceback.print_exc()
        print(f"{idx:6d} {case_id(case):70s} {time.time() - t0:7.2f}s {status}", flush=True)
        if status != "ok" and args.stop_on_fail:
            break
    print(f"\n{n_ok} ok, {len(failures)} failed, {n_skip} skipped (size) in {time.time() - t_start:.0f}s")
    for f in failures:
        print("failed:", f)
    return 1 if failures else 0


def write_result(name: str, text: str, folder=None) -> Path:
    """Write ``text`` to ``folder/name`` (default bench/results/name), making the folder."""
    path = Path(folder or RESULTS) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def row(*cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_head(*columns: str, right: tuple = ()) -> list[str]:
    """A markdown table's header and rule; columns whose index is in ``right`` are right-aligned."""
    return [row(*columns), "|" + "|".join("---:" if i in right else "---" for i in range(len(columns))) + "|"]


def per_call_us(calls: dict, iters: int, rounds: int = 7, warmup=None) -> dict:
    """Median µs per call of each ``name: fn`` or ``name: (fn, before, context)``: ``before``
    (or None) runs untimed before each call, ``context`` (or None) makes the context the calls
    run in.  Rounds interleave the rows, so load on a shared machine shifts every row alike and
    the ratios hold.  ``warmup``: untimed calls of each first (default max(20, iters / 10))."""
    calls = {name: spec if isinstance(spec, tuple) else (spec, None, None) for name, spec in calls.items()}

    def timed(fn, before, context, n):
        with context() if context else contextlib.nullcontext():
            if before is None:
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                return time.perf_counter() - start
            total = 0.0
            for _ in range(n):
                before()
                start = time.perf_counter()
                fn()
                total += time.perf_counter() - start
            return total

    samples = {name: [] for name in calls}
    for fn, before, context in calls.values():
        timed(fn, before, context, max(20, iters // 10) if warmup is None else warmup)
    for _ in range(rounds):
        for name, (fn, before, context) in calls.items():
            n = iters if before is None else max(1, iters // 10)
            samples[name].append(timed(fn, before, context, n) / n * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def allocations(fn) -> tuple[int, int]:
    """(peak of allocated - freed, sum of all allocations) by torch's CPU allocator during fn():
    the profiler's memory events (signed sizes), replayed in time order."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = total = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
        total += max(e.nbytes(), 0)
    return peak, total


def load_source(name: str, path: Path, package=None):
    """Execute ``path`` as the module ``name``, beside the modules already imported: a file,
    with relative imports against ``package``, or a package's folder, whose submodules then
    import from that folder (another revision's or checkout's code next to the imported one)."""
    path = Path(path)
    if path.is_dir():
        spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                      submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if package is not None:
        module.__package__ = package
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
