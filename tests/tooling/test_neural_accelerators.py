"""The rule for the neural-accelerator path (csrc/metal/neural_accelerators.h,
what the launcher's ``neural_accelerators()`` applies to ``MTLDevice.architecture.name``
and the OS version): compiled with the emulator's clang and run here, so it is
checked without a Mac; and the family the backends plan with."""
import subprocess

import pytest

from torch_metal_flash import emulator
from torch_metal_flash._paths import csrc_dir
from torch_metal_flash.backends import metal
from torch_metal_flash.backends.emulator import EmulatorBackend

DRIVER = r"""
#include "metal/neural_accelerators.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
using namespace torch_metal_flash::nax;
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "os:", 3) == 0) {
      long major = std::strtol(argv[i] + 3, nullptr, 10);
      long minor = std::strtol(std::strchr(argv[i], '.') + 1, nullptr, 10);
      std::printf("%s\n", os_reason(major, minor).c_str());
    } else if (std::strncmp(argv[i], "src:", 4) == 0) {
      std::printf("%d\n", is_nax_source(argv[i] + 4) ? 1 : 0);
    } else {
      Architecture a = parse_architecture(argv[i]);
      std::printf("%d %c|%s\n", a.generation, a.variant ? a.variant : '-', gpu_reason(argv[i]).c_str());
    }
  }
}
"""


@pytest.fixture(scope="module")
def rule(tmp_path_factory):
    """Runs the compiled rule on its arguments; returns one output line per argument."""
    work = tmp_path_factory.mktemp("nax_rule")
    (work / "driver.cpp").write_text(DRIVER)
    compiler = emulator.find_compiler()
    build = subprocess.run([*compiler.argv, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(csrc_dir()),
                            str(work / "driver.cpp"), "-o", str(work / "driver")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    return lambda *args: subprocess.run([str(work / "driver"), *args], capture_output=True, text=True,
                                        check=True).stdout.splitlines()


def test_architecture_names_parse_to_generation_and_variant(rule):
    assert rule("applegpu_g17s", "applegpu_g16s", "applegpu_g13g", "applegpu_g17p", "applegpu_g100d") == [
        "17 s|", "16 s|GPU applegpu_g16s (needs architecture generation 17, M5 or newer)",
        "13 g|GPU applegpu_g13g (needs architecture generation 17, M5 or newer)",
        "17 p|GPU applegpu_g17p (phone-class 'p' GPUs need architecture generation 18)", "100 d|"]


def test_generation_17_and_newer_have_the_path_phone_class_from_18(rule):
    assert rule("applegpu_g17g", "applegpu_g17d", "applegpu_g18p", "applegpu_g19s") == ["17 g|", "17 d|", "18 p|",
                                                                                         "19 s|"]


def test_names_that_are_not_apple_gpu_architectures_have_no_path(rule):
    for line in rule("", "AMD Radeon", "applegpu_gXs", "applegpu_g"):
        generation, why = line.split("|")
        assert generation.startswith("-1") and "needs generation 17, M5 or newer" in why
    assert rule("")[0].endswith("GPU (no architecture name) (not an Apple GPU architecture name; the "
                                "neural-accelerator path needs generation 17, M5 or newer)")


def test_os_reason_names_the_version_macos_26_reporting_as_16_to_older_sdks(rule):
    compat = ("(its compatibility version for programs built with an SDK older than macOS 26: run a Python built "
              "with the macOS 26 SDK, or set SYSTEM_VERSION_COMPAT=0)")
    assert rule("os:26.1", "os:15.6", "os:16.1", "os:16.2") == [
        "macOS 26.1 (the neural-accelerator path needs macOS 26.2)",
        "macOS 15.6 (the neural-accelerator path needs macOS 26.2)",
        f"macOS 26.1, which this process sees as 16.1 {compat} (the neural-accelerator path needs macOS 26.2)",
        f"macOS 26.2, which this process sees as 16.2 {compat}"]


def test_only_nax_sources_are_msl4(rule):
    assert rule("src:flash_fwd_nax.metal", "src:flash_fwd.metal", "src:flash_nax.h", "src:_nax.metal") == [
        "1", "0", "0", "1"]


# ---------------------------------------------------------------------------
# The family the backends plan with.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("hardware, reason, planned", [
    ("apple10", "", "apple10"),
    ("apple11", "", "apple10"),  # the newest table
    ("apple10", "macOS 26.1 (the neural-accelerator path needs macOS 26.2)", "apple9"),
    ("apple11", "GPU applegpu_g17p (phone-class 'p' GPUs need architecture generation 18)", "apple9"),
    ("apple9", "", "apple9"),  # no apple10 tables without the family, whatever the launcher says
    ("apple9", "GPU applegpu_g16s (needs architecture generation 17, M5 or newer)", "apple9"),
    ("apple8", "GPU applegpu_g14g (needs architecture generation 17, M5 or newer)", "apple8"),
    ("apple7", "x", "apple7"),
    ("mac2", "x", "mac2"),  # the planner names what it cannot serve
    ("unknown", "x", "unknown"),
])
def test_planning_family(hardware, reason, planned):
    assert metal.planning_family(hardware, reason) == planned


def test_planning_family_checks_its_arguments():
    with pytest.raises(TypeError, match="accelerator_reason"):
        metal.planning_family("apple10", None)
    with pytest.raises(TypeError, match="hw_family"):
        metal.planning_family(10, "")


def test_emulator_has_the_path_when_it_plans_as_apple10():
    backend = EmulatorBackend()
    assert backend.neural_accelerators_reason == "the emulator plans as apple8"
    with emulator.settings(family="apple10"):
        assert backend.neural_accelerators_reason == ""
    with emulator.settings(family="apple9"):
        assert backend.neural_accelerators_reason == "the emulator plans as apple9"


def test_emulator_refuses_nax_sources_unless_it_plans_as_apple10():
    with pytest.raises(RuntimeError, match=r"shaders/flash_fwd_nax\.metal is a neural-accelerator kernel.*"
                                           r"the emulator plans as apple8.*emulator\.settings\(family='apple10'\)"):
        EmulatorBackend().library("flash_fwd_nax.metal", {})


def test_the_launchers_tensor_op_probe_runs_as_the_accelerators_do():
    """The small Metal 4 kernel the launcher compiles before it turns the path on (a header that cannot be
    reached, or a compiler without the tensor ops, makes the path report why and plan as apple9): valid MSL
    4.0 here, and its 16x32x16 multiply right under Apple10's layout."""
    import re

    import torch

    from support.tensor_layouts import offsets

    header = (csrc_dir() / "metal" / "neural_accelerators.h").read_text()
    source = re.search(r'kProbeSource = R"METAL\((.*?)\)METAL"', header, re.S).group(1)
    kernel = re.search(r'kProbeKernel = "(\w+)"', header).group(1)
    lib = emulator.compile_shader(source, name="tensor_op_probe.metal", language_version="4.0", math_mode="safe")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=g).half(), torch.randn(32, 16, generator=g).half()  # b: N x K (transposed)
    lanes = lambda rows, cols: offsets([(rows, cols, False)], "apple10").long()  # noqa: E731
    d = torch.zeros(16 * 32)
    with emulator.settings(family="apple10"):
        lib[kernel](a.flatten()[lanes(16, 16)], b.flatten()[lanes(32, 16)], d, grid=32, threadgroup=32)
    got = torch.zeros(16 * 32)
    got[lanes(16, 32)] = d
    want = a.double() @ b.double().t()
    assert (got.view(16, 32).double() - want).abs().max() < 1e-2
