"""Ring attention (tmf.distributed.ring_attention) on spawned gloo processes on this machine:
what each rank sends per ring step, and its memory as the sequence grows.

    python bench/ring.py            # prints markdown; writes bench/results/ring.md
    python bench/ring.py --quick    # smaller problems

Per world size (2 and 4 ranks) and total length L, causal, float16, B=1, Hq=8, Hkv=2, D=64,
forward and backward on every rank (kernels in the emulator, strict mode):

1. Bytes each rank hands to torch.distributed per ring step (counted at ``batch_isend_irecv``,
   the sizes of its isend buffers): the forward sends its K/V block (world - 1 steps), the
   backward the K/V block (world - 1 steps) and the block's float32 dK/dV partials (world
   steps: their last hop brings them home).  Expected: ``2 B Hkv L_local D`` elements of K/V,
   as many of dK/dV in float32 (twice the bytes of float16 K/V).
2. Peak of torch's CPU allocator on the rank during forward + backward, beyond the inputs
   (what the rank allocates: outputs, gradients, float32 accumulators, received blocks,
   each call's outputs).  Target: O(L / world) -- doubling L doubles it, doubling the world
   halves it.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import harness

import torch_metal_flash as tmf
from torch_metal_flash.testing import randn
from support.ring_cases import run_world

HQ, HKV, D, DTYPE = 8, 2, 64, torch.float16


def _measure(rank: int, world: int, lengths: list[int]) -> list[dict]:
    """Job: per L, this rank's bytes per step (forward, backward) and allocator peak, gathered from every rank."""
    sent: list[int] = []
    original = dist.batch_isend_irecv

    def counting(ops):
        sent.append(sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend))
        return original(ops)

    dist.batch_isend_irecv = counting
    rows = []
    for L in lengths:
        g = torch.Generator().manual_seed(rank)
        local = L // world
        q = randn(1, HQ, local, D, generator=g, dtype=DTYPE).requires_grad_()
        k, v = (randn(1, HKV, local, D, generator=g, dtype=DTYPE).requires_grad_() for _ in range(2))
        dout = randn(1, HQ, local, D, generator=g, dtype=DTYPE)
        steps = {}

        def step():
            sent.clear()
            out = tmf.distributed.ring_attention(q, k, v, causal=True, enable_gqa=True)
            steps["forward"] = list(sent)
            sent.clear()
            out.backward(dout)
            steps["backward"] = list(sent)

        peak, _ = harness.allocations(step)
        mine = {"L": L, "peak": peak, "forward": steps["forward"], "backward": steps["backward"]}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        rows.append(everyone)
    dist.batch_isend_irecv = original
    return rows


def _per_step(ranks) -> str:
    """'bytes x steps' when every rank sent the same bytes at every step, else every rank's list."""
    lists = [list(r) for r in ranks]
    values = {b for steps in lists for b in steps}
    if len(values) == 1 and len({len(steps) for steps in lists}) == 1:
        return f"{values.pop()} x {len(lists[0])}"
    return "; ".join(str(steps) for steps in lists)


def main() -> int:
    ap = harness.parser(__doc__, results=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    lengths = [256, 512, 1024] if args.quick else [512, 1024, 2048, 4096]
    lines = ["# Ring attention: bytes per step and memory per rank", "",
             f"`python bench/ring.py{' --quick' if args.quick else ''}` -- gloo processes on 127.0.0.1, "
             f"kernels in the emulator (strict), causal, {str(DTYPE)[6:]}, B=1, Hq={HQ}, Hkv={HKV}, D={D}, "
             "forward + backward.", ""]
    lines += ["## Bytes each rank sends per ring step", "",
              *harness.table_head("world", "L", "L_local", "forward: K/V bytes x steps", "backward: K/V bytes x steps",
                                  "backward: dK/dV bytes x steps", "expected K/V", "expected dK/dV",
                                  right=(1, 2, 3, 4, 5, 6, 7))]
    memory = ["", "## Peak allocation per rank (torch's CPU allocator, forward + backward)", "",
              *harness.table_head("world", "L", "L_local", "max over ranks (MiB)", "x previous L",
                                  "per rank (MiB)", right=(1, 2, 3, 4))]
    peaks: dict = {}
    for world in (2, 4):
        rows = run_world(world, _measure, lengths)
        previous = None
        for everyone in rows:
            L = everyone[0]["L"]
            local = L // world
            kv = 2 * HKV * local * D * DTYPE.itemsize
            # the backward's shifts interleave, K/V then dK/dV per step, the last step dK/dV only
            fwd = _per_step(r["forward"] for r in everyone)
            bwd_kv = _per_step(r["backward"][0:-1:2] for r in everyone)
            bwd_g = _per_step(r["backward"][1::2] + r["backward"][-1:] for r in everyone)
            peak = max(r["peak"] for r in everyone)
            peaks.setdefault(L, {})[world] = peak
            lines.append(harness.row(world, L, local, fwd, bwd_kv, bwd_g, kv, kv * 4 // DTYPE.itemsize))
            memory.append(harness.row(world, L, local, f"{peak / 2**20:.2f}",
                                      "" if previous is None else f"{peak / previous:.2f}",
                                      ", ".join(f"{r['peak'] / 2**20:.2f}" for r in everyone)))
            previous = peak
    memory += ["", "Twice the ranks, at the same L: " + ", ".join(
        f"L={L}: {p[4] / p[2]:.2f}x the memory per rank" for L, p in peaks.items()) + "."]
    text = "\n".join(lines + memory) + "\n"
    print(text)
    harness.write_result("ring.md", text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
