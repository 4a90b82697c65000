"""flash-attn's own tests through torch_metal_flash's ``flash_attn`` shim, on the emulator.

No flash-attn code is in this repository: point the script at an extracted flash-attn
sdist (a registry package; its tests/test_flash_attn.py is used unmodified) ::

    FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-binary :all: \\
        --no-build-isolation flash-attn==2.8.3 -d /tmp/fa && tar xzf /tmp/fa/flash_attn-2.8.3.tar.gz -C /tmp/fa
    pip install einops   # the tests import it
    python bench/flash_attn_upstream.py /tmp/fa/flash_attn-2.8.3 -k "test_flash_attn_varlen_causal and not None \
        and (-32- or -59- or -128-) and (1-239 or 3-799 or 113-203)"

    python bench/flash_attn_upstream.py /tmp/fa/flash_attn-2.8.3 --paged-backward

Everything after the sdist path goes to pytest (``-k`` selects the cases).  Upstream's
``test_flash_attn_varlen_causal`` checks gradients only without a block table;
``--paged-backward`` runs its paged cases (its helpers, inputs and reference, a grid of
them: ``PAGED_GRID``) with gradients too, dq and the caches' dk/dv held to the criterion
it applies to the unpaged ones.  A pytest
plugin (below) makes the tests' CUDA device our device: tensors the tests create on
"cuda" are CPU tensors and every torch_metal_flash call runs on the emulator backend in
strict mode (a fallback to the reference path fails the case instead of passing
silently).  The tests' module reads the GPU's compute capability at import: the plugin
answers (8, 0), flash-attn's main target (its head-dim and dtype lists for sm80).
``flash_attn.layers.rotary`` (imported by the module, used only by the KV-cache tests)
is a stub that raises.  bench/results/flash_attn_upstream.md records a run.
"""
from __future__ import annotations

import itertools
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import harness  # noqa: F401  (this checkout's torch_metal_flash)

import torch_metal_flash as tmf

DEVICE = "cpu"  # the emulator backend runs on CPU tensors


def _ours(device):
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return DEVICE
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device(DEVICE)
    return device


class CudaIsOurDevice(TorchFunctionMode):
    """``device="cuda"`` (factories, ``.to``) and ``.cuda()`` land on our device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to(DEVICE)
        if "device" in kwargs:
            kwargs["device"] = _ours(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_ours(a) for a in args)
        return func(*args, **kwargs)


class Plugin:
    """The pytest plugin: the shim, the device mapping, the emulator backend."""

    @staticmethod
    def pytest_configure(config):
        tmf.install_flash_attn_shim()
        torch.cuda.get_device_capability = lambda device=None: (8, 0)
        layers = types.ModuleType("flash_attn.layers")
        rotary = types.ModuleType("flash_attn.layers.rotary")

        def apply_rotary_emb(*args, **kwargs):
            raise NotImplementedError("flash_attn.layers.rotary is not part of this runner (Triton kernels)")

        rotary.apply_rotary_emb = apply_rotary_emb
        layers.rotary = rotary
        sys.modules.update({"flash_attn.layers": layers, "flash_attn.layers.rotary": rotary})

    @staticmethod
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):
        with CudaIsOurDevice(), tmf.backend("emulator", strict=True):
            return (yield)


# --paged-backward: (seqlen_q, seqlen_k) of test_flash_attn_varlen_causal (both orders), head dims,
# page sizes, local, dtypes
PAGED_GRID = dict(seqlens=((113, 203), (3, 799)), d=(32, 128), page=(256,), local=(False, True),
                  dtype=(torch.float16, torch.bfloat16))


def paged_backward_case(mod, seqlen_q, seqlen_k, d, local, page, dtype) -> dict:
    """test_flash_attn_varlen_causal's paged case (its helpers, its inputs and its reference),
    gradients included: dq, and dk/dv of the caches read back through the block table, against
    the same criterion as its unpaged gradients (max error <= 2 x PyTorch's + 1e-5); blocks
    no sequence reads must get zero gradients."""
    torch.random.manual_seed(0)
    batch, heads, device = 8, 9, "cuda"
    window = (-1, -1) if not local else torch.randint(0, seqlen_k, (2,))
    q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=dtype, requires_grad=True)
    k, v, table, k_paged, v_paged, num_blocks = mod._generate_block_kvcache(seqlen_k, page, batch, heads, d, device,
                                                                            dtype)
    q_mask = mod.generate_random_padding_mask(seqlen_q, batch, device, mode="random")
    k_mask = mod.generate_random_padding_mask(seqlen_k, batch, device, mode="random")
    (q_unpad, _, _, cu_q, cu_k, max_q, max_k, q, k, v, out_pad, dq_pad, _) = mod.generate_qkv(q, k, v, q_mask, k_mask)
    k_paged, v_paged = (t.detach().requires_grad_(True) for t in (k_paged, v_paged))
    out = out_pad(mod.flash_attn_varlen_func(q_unpad, k_paged, v_paged, cu_q, cu_k, max_q, max_k, 0.0, causal=True,
                                             window_size=window, block_table=table))
    kw = dict(causal=True, window_size=window)
    out_ref, _ = mod.attention_ref(q, k, v, q_mask, k_mask, None, 0.0, None, **kw)
    out_pt, _ = mod.attention_ref(q, k, v, q_mask, k_mask, None, 0.0, None, upcast=False, reorder_ops=True, **kw)
    g = torch.randn_like(out)
    dq_unpad, dk_paged, dv_paged = torch.autograd.grad(out, (q_unpad, k_paged, v_paged), g)
    rows = table.long().flatten()
    got = [dq_pad(dq_unpad)] + [t[rows].reshape(batch, -1, heads, d)[:, :seqlen_k] for t in (dk_paged, dv_paged)]
    ref, pt = torch.autograd.grad(out_ref, (q, k, v), g), torch.autograd.grad(out_pt, (q, k, v), g)
    res = {}
    for name, x, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        err, allowed = (x - r).abs().max().item(), 2 * (p - r).abs().max().item() + 1e-5
        res[name] = (err, allowed)
    read = torch.zeros(num_blocks, dtype=torch.bool)
    lens = (cu_k[1:] - cu_k[:-1]).tolist()
    for b, n in enumerate(lens):
        read[table[b, :-(-n // page)].long()] = True
    res["unread_zero"] = not dk_paged[~read].any() and not dv_paged[~read].any()
    return res


def paged_backward(tests: Path) -> int:
    Plugin.pytest_configure(None)
    sys.path.insert(0, str(tests.parent))
    import importlib
    mod = importlib.import_module(tests.stem)
    failures = cases = 0
    for (sq, sk), swap, d, page, local, dtype in itertools.product(
            PAGED_GRID["seqlens"], (False, True), PAGED_GRID["d"], PAGED_GRID["page"], PAGED_GRID["local"],
            PAGED_GRID["dtype"]):
        if swap:
            sq, sk = sk, sq
        t0 = time.perf_counter()
        with CudaIsOurDevice(), tmf.backend("emulator", strict=True):
            res = paged_backward_case(mod, sq, sk, d, local, page, dtype)
        ok = res.pop("unread_zero") and all(err <= allowed for err, allowed in res.values())
        cases, failures = cases + 1, failures + (not ok)
        errs = "  ".join(f"{n} {e:.2e} <= {a:.2e}" for n, (e, a) in res.items())
        print(f"{'PASS' if ok else 'FAIL'} seqlen_q={sq} seqlen_k={sk} d={d} page={page} local={local} "
              f"{str(dtype)[6:]}: {errs} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"{cases - failures} passed, {failures} failed")
    return int(failures > 0)


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    tests = Path(argv[0]) / "tests" / "test_flash_attn.py"
    if not tests.is_file():
        print(f"{tests}: not found (the path of an extracted flash-attn sdist)", file=sys.stderr)
        return 2
    if argv[1:] == ["--paged-backward"]:
        return paged_backward(tests)
    return pytest.main([str(tests), "-p", "no:cacheprovider", "--rootdir", str(tests.parent), "-c", os.devnull,
                        *argv[1:]], plugins=[Plugin()])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
