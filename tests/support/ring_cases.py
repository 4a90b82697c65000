"""Ring attention's problems and a local process group to run them (tests/distributed, bench/ring.py).

:func:`run_world` spawns ``world`` processes joined by gloo on the loopback address, runs a
job on every rank with the chosen backend (strict: no silent fallback) and returns rank 0's
result.  One spawn serves a whole list of problems: starting a process (importing torch and
the package) costs seconds, a problem at these sizes milliseconds.

:func:`ring_results` is that job for :class:`RingCase` problems: every rank draws the same
whole-sequence inputs (:func:`~torch_metal_flash.testing.randn`, seeded), runs
``ring_attention`` forward and backward on its rows, and the ranks' rows are gathered and
put back in sequence order, to be judged against the float64 oracle over the whole sequence.
"""
from __future__ import annotations

import dataclasses
import io
import socket
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_metal_flash.backends import backend as use_backend
from torch_metal_flash.diagnostics import run_counts
from torch_metal_flash.distributed import ring_attention_with_lse, zigzag_shard, zigzag_unshard
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing.oracle import randn


@dataclasses.dataclass(frozen=True)
class RingCase:
    """A whole-sequence problem of ``world * local_len`` rows, split over the ranks."""
    dtype: torch.dtype = torch.float32
    causal: bool = False
    load_balance: bool = False
    heads: int = 2
    kv_heads: int = 2
    local_len: int = 8
    head_dim: int = 16
    batch: int = 1
    seed: int = 0

    @property
    def name(self) -> str:
        return (f"{str(self.dtype)[6:]}_{'causal' if self.causal else 'full'}"
                f"{'_zigzag' if self.load_balance else ''}_h{self.heads}kv{self.kv_heads}_l{self.local_len}")

    def inputs(self, world: int):
        """Whole-sequence q, k, v, dout (the same on every rank and machine)."""
        g = torch.Generator().manual_seed(self.seed)
        L = world * self.local_len
        shape = lambda h: (self.batch, h, L, self.head_dim)  # noqa: E731
        q, k, v, dout = (randn(*shape(h), generator=g, dtype=self.dtype)
                         for h in (self.heads, self.kv_heads, self.kv_heads, self.heads))
        return q, k, v, dout

    def spec(self, q, k, v):
        """The whole-sequence problem ``ring_attention`` computes (SDPA's top-left causal)."""
        return make_spec(q, k, v, scale=self.head_dim ** -0.5, window_right=0 if self.causal else -1)

    def shard(self, x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        return zigzag_shard(x, rank, world) if self.load_balance else x.chunk(world, dim=2)[rank]

    def unshard(self, x: torch.Tensor, world: int) -> torch.Tensor:
        return zigzag_unshard(x, world) if self.load_balance else x


# What tests/distributed runs on 2, 3 and 4 ranks: every dtype, causal or not, load-balanced or
# not, GQA; 4 ranks have rows of 2 keys per half chunk (load_balance) -- kernel blocks cut mid-tile.
CASES = {
    2: [RingCase(torch.float32, causal=True), RingCase(torch.float16, causal=True, load_balance=True, kv_heads=1),
        RingCase(torch.bfloat16, causal=False, heads=4, kv_heads=2), RingCase(torch.float32, load_balance=True)],
    3: [RingCase(torch.float16, causal=True), RingCase(torch.bfloat16, causal=True, load_balance=True),
        RingCase(torch.float32, causal=True, load_balance=True, heads=4, kv_heads=1, local_len=6),
        RingCase(torch.float16, causal=False, kv_heads=1)],
    4: [RingCase(torch.float32, causal=True, heads=4, kv_heads=2), RingCase(torch.bfloat16, causal=False),
        RingCase(torch.float16, causal=True, load_balance=True, local_len=4)],
}


def ring_results(rank: int, world: int, cases: list[RingCase]) -> dict:
    """Job: {case name: whole-sequence out, lse, dq, dk, dv and each rank's op calls} (rank 0's)."""
    results = {}
    for case in cases:
        q, k, v, dout = case.inputs(world)
        mine = [case.shard(t, rank, world).clone().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        before = _calls()
        out, lse = ring_attention_with_lse(*mine[:3], causal=case.causal, enable_gqa=case.heads != case.kv_heads,
                                           load_balance=case.load_balance)
        out.backward(mine[3])
        calls = torch.tensor([_calls() - before], dtype=torch.int64)
        parts = [out.detach(), lse.to(torch.float64)] + [t.grad for t in mine[:3]]
        whole = [case.unshard(torch.cat(_gather(t.contiguous(), world), dim=2), world) for t in parts]
        results[case.name] = dict(zip(("out", "lse", "dq", "dk", "dv"), whole),
                                  calls=torch.cat(_gather(calls, world)).tolist())
    return results


def _calls() -> int:
    return sum(run_counts().values())  # the op calls of every backend, kernels and reference alike


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return parts


# ---------------------------------------------------------------------------
# A process group on this machine.
# ---------------------------------------------------------------------------

def run_world(world: int, job: Callable, *args, backend: str = "emulator", timeout: float = 600.0):
    """Run ``job(rank, world, *args)`` on ``world`` spawned processes joined by gloo on 127.0.0.1,
    under ``torch_metal_flash.backend(backend, strict=True)``; returns rank 0's result.  An
    exception on any rank is raised here with its traceback.  ``job`` must be importable by name."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world, port, backend, job, args, queue), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        answers = {}
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            answers[rank] = (ok, value)
            if not ok:
                break
    finally:
        for p in procs:
            p.join(timeout=30 if len(answers) == world else 1)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, (ok, v) in answers.items() if not ok}
    if failed:
        rank, text = min(failed.items())
        raise RuntimeError(f"rank {rank} of {world} failed:\n{text}")
    return torch.load(io.BytesIO(answers[0][1]))


def _to_bytes(result) -> bytes:
    # by value: a tensor put on a queue as is lives in the sender's shared memory, gone when it exits
    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def _rank_main(rank: int, world: int, port: int, backend: str, job: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            with use_backend(backend, strict=True):
                result = job(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, _to_bytes(result) if rank == 0 else None))
    except BaseException:  # noqa: BLE001  (the parent raises it with the traceback)
        queue.put((rank, False, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# Wrong calls: {name: build(rank, world) -> (args, kwargs)}; every rank calls ring_attention with them.
# ---------------------------------------------------------------------------

def _tensors(rank: int, local_len: int = 8, dtype=torch.float32, heads: int = 2):
    return [torch.zeros(1, heads, local_len, 16, dtype=dtype) for _ in range(3)]


def _unequal_chunks(rank, world):
    return _tensors(rank, local_len=8 if rank == 0 else 6), {}


def _mixed_dtypes(rank, world):
    return _tensors(rank, dtype=torch.float16 if rank == 0 else torch.float32), {}


def _mixed_causal(rank, world):
    return _tensors(rank), {"causal": rank == 0}


def _not_a_group(rank, world):
    return _tensors(rank), {"group": "world"}


def _not_a_member(rank, world):
    return _tensors(rank), {"group": dist.new_group([0])}  # every rank must call new_group


ERRORS = {"unequal_chunks": _unequal_chunks, "mixed_dtypes": _mixed_dtypes, "mixed_causal": _mixed_causal,
          "not_a_group": _not_a_group, "not_a_member": _not_a_member}


def ring_errors(rank: int, world: int, names: list[str]) -> dict:
    """Job: {name: [what each rank's ring_attention raised ("Type: message"), None if it returned]}."""
    found = {}
    for name in names:
        try:
            args, kwargs = ERRORS[name](rank, world)
            ring_attention_with_lse(*args, **kwargs)
            text = None
        except (ValueError, TypeError, RuntimeError) as e:
            text = f"{type(e).__name__}: {e}"
        texts = [None] * world
        dist.all_gather_object(texts, text)
        found[name] = texts
    return found


def ring_suite(rank: int, world: int, cases: list[RingCase], errors: list[str]) -> dict:
    """Job: :func:`ring_results` and :func:`ring_errors` in one set of processes."""
    return {"cases": ring_results(rank, world, cases), "errors": ring_errors(rank, world, errors)}
