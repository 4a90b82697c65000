"""ring_attention on 2, 3 and 4 spawned processes (gloo on 127.0.0.1), the kernels in the emulator
in strict mode, judged against float64 attention over the whole sequence (torch_metal_flash.testing).

One set of processes per world size runs every problem and wrong call of that size
(tests/support/ring_cases.py): starting a process costs seconds, a problem milliseconds."""
import functools

import pytest
import torch

import torch_metal_flash as tmf
from torch_metal_flash.distributed import layout
from torch_metal_flash.testing import check_backward, check_forward
from support.ring_cases import CASES, ERRORS, ring_suite, run_world

WORLDS = sorted(CASES)


@functools.cache
def _suite(world: int) -> dict:
    return run_world(world, ring_suite, CASES[world], list(ERRORS))


@pytest.mark.parametrize("world,case", [(w, c) for w in WORLDS for c in CASES[w]],
                         ids=[f"w{w}-{c.name}" for w in WORLDS for c in CASES[w]])
def test_forward_and_backward_match_whole_sequence_float64_attention(world, case):
    got = _suite(world)["cases"][case.name]
    q, k, v, dout = case.inputs(world)
    spec = case.spec(q, k, v)
    check_forward(spec, got["out"], got["lse"].to(torch.float32))
    check_backward(spec, dout, None, (got["dq"], got["dk"], got["dv"], None, None))


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_runs_kernels_only_on_the_blocks_its_band_needs(world):
    """Contiguous causal: rank r's queries see no key of blocks r+1.., so it runs r + 1 forward
    and r + 1 backward calls; zigzag: every rank the same number; not causal: one per block each."""
    for case in CASES[world]:
        calls = _suite(world)["cases"][case.name]["calls"]
        if not case.causal:
            want = [2 * world] * world
        elif case.load_balance:
            want = [2 * (3 + world - 1)] * world  # the diagonal step: 3 calls; every other step: 1
        else:
            want = [2 * (r + 1) for r in range(world)]
        assert calls == want, case.name


def test_unequal_chunks_fail_on_every_rank_naming_them():
    texts = _suite(3)["errors"]["unequal_chunks"]
    assert all(t == texts[0] for t in texts), texts
    assert texts[0] == ("ValueError: ring_attention: every rank of the group must pass equal chunks (L_local); "
                        "got rank 0: 8, rank 1: 6, rank 2: 6")


def test_mismatched_dtypes_and_flags_fail_on_every_rank():
    errors = _suite(2)["errors"]
    assert errors["mixed_dtypes"] == ["ValueError: ring_attention: every rank of the group must pass the same "
                                      "dtype; got rank 0: float16, rank 1: float32"] * 2
    assert errors["mixed_causal"] == ["ValueError: ring_attention: every rank of the group must pass the same "
                                      "causal; got rank 0: 1, rank 1: 0"] * 2


def test_a_bad_group_is_named():
    errors = _suite(2)["errors"]
    assert errors["not_a_group"] == ["TypeError: ring_attention: group must be a torch.distributed.ProcessGroup "
                                     "or None (the default group), got str"] * 2
    rank0, rank1 = errors["not_a_member"]
    assert rank0 is None  # a group of one: attention over its own rows
    assert rank1.startswith("ValueError: ring_attention: this process (global rank 1) is not a member of group")


def test_without_a_process_group_the_error_says_how_to_start_one():
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        tmf.distributed.ring_attention(q, q, q)


@pytest.mark.parametrize("kwargs,shapes,message", [
    ({}, [(1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)], r"q's heads \(4\) must be equal to \(or pass enable_gqa"),
    ({"enable_gqa": True}, [(1, 4, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16)], r"must be a multiple of k/v's heads"),
    ({"load_balance": True}, [(1, 2, 7, 16)] * 3, r"load_balance=True needs an even L_local"),
    ({}, [(1, 2, 8, 16), (1, 2, 6, 16), (1, 2, 6, 16)], r"same rows of the sequence \(L_local\)"),
])
def test_local_arguments_are_checked_before_any_communication(kwargs, shapes, message):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        tmf.distributed.ring_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("load_balance", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_calls_of_a_step_cover_each_visible_pair_once_and_no_hidden_block(world, load_balance, causal):
    L = 6
    for rank in range(world):
        q_runs = layout.runs(rank, world, L, load_balance)
        pos = torch.cat([torch.arange(r.start, r.start + r.length) for r in q_runs])
        for src in range(world):
            k_runs = layout.runs(src, world, L, load_balance)
            kpos = torch.cat([torch.arange(r.start, r.start + r.length) for r in k_runs])
            visible = (kpos[None, :] <= pos[:, None]) if causal else torch.ones(L, L, dtype=torch.bool)
            covered = torch.zeros(L, L, dtype=torch.int64)
            for call in layout.calls(q_runs, k_runs, causal):
                i = torch.arange(L)[call.q][:, None] - call.q.start
                j = torch.arange(L)[call.k][None, :] - call.k.start
                band = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool) if call.diag_offset is None else (
                    j <= i + call.diag_offset)
                assert torch.equal(band, visible[call.q, call.k]), (rank, src, call)  # the band is the mask
                assert band.any(), (rank, src, call)  # no call on a block nobody sees
                covered[call.q, call.k] += band
            assert torch.equal(covered, visible.long()), (rank, src)  # every visible pair, once


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zigzag_shard_and_unshard_are_inverse_and_balance_causal_work(world):
    x = torch.arange(2 * world * 3).view(1, 1, -1, 1)
    parts = [tmf.distributed.zigzag_shard(x, r, world) for r in range(world)]
    assert torch.equal(tmf.distributed.zigzag_unshard(torch.cat(parts, dim=2), world), x)
    pairs = [sum(int(p) + 1 for p in part.flatten()) for part in parts]  # causal (query, key) pairs per rank
    assert len(set(pairs)) == 1
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size = 4"):
        tmf.distributed.zigzag_shard(torch.zeros(1, 1, 6, 1), 0, 2)


def test_a_message_packs_tensors_of_several_dtypes_and_gives_them_back():
    from torch_metal_flash.distributed.transport import pack, unpack
    parts = [torch.arange(6, dtype=torch.float16).view(1, 2, 3), torch.arange(4, dtype=torch.float32).view(2, 2),
             torch.tensor([1.5], dtype=torch.bfloat16)]
    buf = pack([parts[0].transpose(1, 2), *parts[1:]], torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.numel() == 6 * 2 + 4 * 4 + 2
    got = unpack(buf, [((1, 3, 2), torch.float16), ((2, 2), torch.float32), ((1,), torch.bfloat16)],
                 torch.device("cpu"))
    for g, want in zip(got, [parts[0].transpose(1, 2), *parts[1:]]):
        assert g.dtype == want.dtype and torch.equal(g, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_backward_calls_on_key_blocks_with_the_whole_rows_state_sum_to_the_whole_gradient(backend, dtype):
    """What the ring's backward relies on, on both backends: bwd on a block of keys, given the
    whole row's state (aux = (lse, 1), the whole output), returns that block's share."""
    from torch_metal_flash.testing import randn
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (randn(1, 2, 12, 16, generator=g, dtype=dtype) for _ in range(4))
    scale = 0.25
    with tmf.backend(backend, strict=True):
        out, lse, aux = torch.ops.metal_flash.fwd(q, k, v, None, None, None, scale, 0, -1, 0, 0.0, True)
        state = torch.cat((torch.stack((lse, torch.ones_like(lse)), -1), aux[..., 2:]), -1)
        dq = torch.zeros(q.shape, dtype=torch.float32)
        dks, dvs = [], []
        for k0, k1 in ((0, 5), (5, 12)):  # causal: rows before key 5 see nothing of the second block
            g_q, g_k, g_v, _, _ = torch.ops.metal_flash.bwd(dout, q, k[:, :, k0:k1], v[:, :, k0:k1], out, state, None,
                                                            None, None, None, scale, -k0, -1, 0, 0.0, False)
            dq += g_q
            dks.append(g_k)
            dvs.append(g_v)
    spec = tmf.problem.spec.make_spec(q, k, v, scale=scale, window_right=0)
    check_backward(spec, dout, None, (dq.to(dtype), torch.cat(dks, 2), torch.cat(dvs, 2), None, None))
