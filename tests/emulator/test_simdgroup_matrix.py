"""simdgroup_matrix: MMA against numpy matmul, transposes and origins, and the lane layout."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from emu_helpers import lib

LAYOUT = np.zeros((8, 8), np.int64)
for lane in range(32):
    qid = lane // 4
    r = (qid & 4) + (lane // 2) % 4
    c = (qid & 2) * 2 + (lane % 2) * 2
    LAYOUT[r, c], LAYOUT[r, c + 1] = 2 * lane, 2 * lane + 1


def test_thread_elements_layout():
    out, diag, prod, st_t = (np.zeros((8, 8), np.float32) for _ in range(4))
    st = lib("matrix.metal").layout(out, diag, prod, st_t, grid=32, threadgroup=32)
    np.testing.assert_array_equal(out, LAYOUT)
    np.testing.assert_array_equal(diag, 3 * np.eye(8))
    np.testing.assert_array_equal(prod, 3 * LAYOUT)
    np.testing.assert_array_equal(st_t, LAYOUT.T)
    assert st.simdgroup_matrix_multiplies == 1


CASES = [("float", "float", torch.float32, 1e-5), ("half", "float", torch.float16, 1e-3),
         ("half", "half", torch.float16, 2e-2), ("bfloat", "float", torch.bfloat16, 1e-3)]


@pytest.mark.parametrize("tname,acc,dtype,tol", CASES)
@pytest.mark.parametrize("flags", [0, 1, 2, 3])
def test_gemm_against_numpy(tname, acc, dtype, tol, flags):
    M, N, K = 32, 16, 24
    torch.manual_seed(flags)
    a = torch.randn(M, K).to(dtype)
    b = torch.randn(K, N).to(dtype)
    A = a.t().contiguous() if flags & 1 else a
    B = b.t().contiguous() if flags & 2 else b
    C = torch.zeros(M, N, dtype=torch.float32 if acc == "float" else dtype)
    kern = lib("matrix.metal")[f"gemm_{tname}_{acc}"]
    st = kern(A, B, C, M, N, K, flags, grid=(N // 16 * 128, M // 16), threadgroup=(128, 1), checked=flags == 3)
    ref = a.double().numpy() @ b.double().numpy()
    np.testing.assert_allclose(C.double().numpy(), ref, rtol=tol, atol=tol * 4)
    assert st.simdgroup_matrix_multiplies == (M // 8) * (N // 8) * (K // 8)
    if flags == 3:
        esz = a.element_size()
        # every lane loads its 2 elements of each operand: A and B read (N/8) and (M/8) times
        assert st.bytes_read[0] == M * K * esz * (N // 8)
        assert st.bytes_read[1] == K * N * esz * (M // 8)
        assert st.bytes_written[2] == M * N * C.element_size()
