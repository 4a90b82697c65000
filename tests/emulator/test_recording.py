"""emulator.recording(): every launch inside it is recorded, with exact counts; context-local and nestable."""
from __future__ import annotations

import threading

import torch

import torch_metal_flash as tmf
from torch_metal_flash import emulator
from torch_metal_flash.backends import instance

# One simdgroup per threadgroup multiplies an 8x8 tile pair staged through threadgroup memory.
TILE_MM = """
#include <metal_stdlib>
using namespace metal;
kernel void tile_mm(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                    device float* c [[buffer(2)]], uint lane [[thread_index_in_simdgroup]],
                    uint tg [[threadgroup_position_in_grid]]) {
  threadgroup float ta[64], tb[64];
  for (uint i = lane; i < 64; i += 32) { ta[i] = a[tg * 64 + i]; tb[i] = b[tg * 64 + i]; }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 x, y, z;
  simdgroup_load(x, ta, 8);
  simdgroup_load(y, tb, 8);
  simdgroup_multiply(z, x, y);
  simdgroup_store(z, c + tg * 64, 8);
}
"""


def _tile_mm(tiles: int):
    a, b = torch.randn(tiles, 8, 8), torch.randn(tiles, 8, 8)
    c = torch.zeros(tiles, 8, 8)
    emulator.compile_shader(TILE_MM).tile_mm(a, b, c, grid=32 * tiles, threadgroup=32, checked=True)
    torch.testing.assert_close(c, a @ b)


def test_counts_of_a_known_kernel_are_exact():
    tiles = 3
    with emulator.recording() as launches:
        _tile_mm(tiles)
    (st,) = launches
    assert st.kernel == "tile_mm" and st.threadgroups == tiles and st.threads == 32 * tiles
    # each tile of a and b read once from device memory, each tile of c written once
    assert st.bytes_read == {0: tiles * 256, 1: tiles * 256, 2: 0}
    assert st.bytes_written == {0: 0, 1: 0, 2: tiles * 256}
    assert st.device_bytes_read == 2 * tiles * 256 and st.device_bytes_written == tiles * 256
    assert st.threadgroup_memory == 2 * 256
    assert st.threadgroup_bytes_written == 2 * tiles * 256  # the staging stores
    assert st.threadgroup_bytes_read == 2 * tiles * 256  # the two simdgroup_loads
    assert st.barriers == tiles  # one per threadgroup
    assert st.simdgroup_matrix_multiplies == tiles


def test_nested_recordings_each_receive_every_launch_inside():
    with emulator.recording() as outer:
        _tile_mm(1)
        with emulator.recording() as inner:
            _tile_mm(2)
        _tile_mm(4)
    _tile_mm(5)  # after both: in neither
    assert [s.threadgroups for s in outer] == [1, 2, 4]
    assert [s.threadgroups for s in inner] == [2]
    assert inner[0] is outer[1]


def test_recording_is_context_local():
    seen = []

    def other_thread():
        with emulator.recording() as mine:
            _tile_mm(7)
        seen.extend(mine)

    with emulator.recording() as launches:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        _tile_mm(2)
    assert [s.threadgroups for s in launches] == [2]
    assert [s.threadgroups for s in seen] == [7]


def test_every_launch_of_a_plan_is_recorded_forward_and_backward():
    backend = instance("emulator")
    q, k, v = (torch.randn(1, 40, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    with tmf.backend("emulator"), emulator.recording() as launches:
        out = tmf.flash_attn_func(q, k, v, causal=True)
        forward = list(backend.last_stats)
        out.float().square().sum().backward()
        backward = list(backend.last_stats)
    assert forward and backward and forward != backward
    assert launches == forward + backward
    assert launches[0].kernel.startswith("flash_fwd_f16_d64")
    assert all(s.device_bytes for s in launches)  # checked mode by default: exact byte counts
