"""Host-side overhead per attention call, with the kernel launch stubbed out.

Measures, on tiny inputs where the math is negligible:
  * torch's whole ``F.scaled_dot_product_attention`` call (the bar to compare with),
  * our full path — public face → op → planner → parameter packing → Metal
    backend — with ``_C.launch`` replaced by a no-op (so only the host work remains),
  * the pieces: the op dispatch alone (planning skipped) and planning alone.

    python bench/overhead.py [--iters N]

Timings are noisy on shared machines: read the ratios, not the absolutes.
Results go to stdout and bench/results/overhead.md.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

import torch_metal_flash as tmf  # noqa: E402
from torch_metal_flash import backends, planner  # noqa: E402
from torch_metal_flash.backends import metal  # noqa: E402
from torch_metal_flash.layout import empty_in_layout  # noqa: E402
from torch_metal_flash.spec import make_spec  # noqa: E402


class _NoLaunch:
    """Stands in for torch_metal_flash._C: accepts launches, runs nothing."""

    def set_shader_dir(self, path):
        pass

    def gpu_family(self):
        return "apple8"

    def launch(self, *args):
        pass


def per_call_us(fn, iters: int) -> float:
    for _ in range(max(10, iters // 10)):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()

    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    k = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    v = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    spec = make_spec(q, k, v, scale=0.125, window_right=0)
    out, lse = empty_in_layout(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    metal._extension = lambda: _NoLaunch()  # the launcher, stubbed
    stub = metal.MetalBackend()
    original_resolve = backends.resolve
    rows = [("torch F.scaled_dot_product_attention (whole call, CPU)",
             per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.iters))]
    try:
        backends.resolve = lambda device: stub
        rows.append(("tmf.scaled_dot_product_attention, launch stubbed",
                     per_call_us(lambda: tmf.scaled_dot_product_attention(q, k, v, is_causal=True), args.iters)))
        rows.append(("torch.ops.metal_flash.fwd, launch stubbed",
                     per_call_us(lambda: torch.ops.metal_flash.fwd(q, k, v, None, None, None, 0.125, 0, -1, 0, 0.0,
                                                                   False), args.iters)))
    finally:
        backends.resolve = original_resolve
    rows.append(("planner.plan_forward alone", per_call_us(lambda: planner.plan_forward(spec, out, lse), args.iters)))
    rows.append(("MetalBackend.run alone (stubbed launch)",
                 per_call_us(lambda p=planner.plan_forward(spec, out, lse): stub.run(p), args.iters)))

    base = rows[0][1]
    lines = ["| path | µs per call | × torch SDPA call |", "|---|---:|---:|"]
    lines += [f"| {name} | {us:.1f} | {us / base:.2f} |" for name, us in rows]
    table = "\n".join(lines)
    print(table)
    out_dir = pathlib.Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "overhead.md").write_text(
        "# Host overhead per call (launch stubbed)\n\n"
        f"`python bench/overhead.py --iters {args.iters}`; q, k, v (1, 2, 8, 64) fp16, causal.\n\n{table}\n")


if __name__ == "__main__":
    main()
