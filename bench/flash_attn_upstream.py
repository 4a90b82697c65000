"""flash-attn's own tests through torch_metal_flash's ``flash_attn`` shim, on the emulator.

No flash-attn code is in this repository: point the script at an extracted flash-attn
sdist (a registry package; its tests/test_flash_attn.py is used unmodified) ::

    FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-binary :all: \\
        --no-build-isolation flash-attn==2.8.3 -d /tmp/fa && tar xzf /tmp/fa/flash_attn-2.8.3.tar.gz -C /tmp/fa
    pip install einops   # the tests import it
    python bench/flash_attn_upstream.py /tmp/fa/flash_attn-2.8.3 -k "test_flash_attn_varlen_causal and 256 and 32"

Everything after the sdist path goes to pytest (``-k`` selects the cases).  A pytest
plugin (below) makes the tests' CUDA device our device: tensors the tests create on
"cuda" are CPU tensors and every torch_metal_flash call runs on the emulator backend in
strict mode (a fallback to the reference path fails the case instead of passing
silently).  The tests' module reads the GPU's compute capability at import: the plugin
answers (8, 0), flash-attn's main target (its head-dim and dtype lists for sm80).
``flash_attn.layers.rotary`` (imported by the module, used only by the KV-cache tests)
is a stub that raises.  bench/results/flash_attn_upstream.md records a run.
"""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch_metal_flash as tmf  # noqa: E402

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


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    tests = Path(argv[0]) / "tests" / "test_flash_attn.py"
    if not tests.is_file():
        print(f"{tests}: not found (the path of an extracted flash-attn sdist)", file=sys.stderr)
        return 2
    return pytest.main([str(tests), "-p", "no:cacheprovider", "--rootdir", str(tests.parent), "-c", os.devnull,
                        *argv[1:]], plugins=[Plugin()])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
