"""The torch range the package supports, declared once in code and once for pip, and what
the package does with a torch or a prebuilt ``_C`` outside it."""
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from torch_metal_flash import native
from torch_metal_flash.backends import metal
from torch_metal_flash.native import build, targets

ROOT = Path(__file__).resolve().parents[2]
MPS = torch.device("mps")  # a device object only: nothing is allocated on it


def test_pyproject_declares_the_packages_range_and_needs_no_torch_to_build():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"{targets.TORCH_REQUIREMENT}" in project["project"]["dependencies"]
    assert not any(r.startswith("torch") for r in project["build-system"]["requires"]), \
        "an isolated build would build _C against a torch other than the one the user runs"


def test_the_running_torch_is_in_the_range():
    assert native.unsupported_torch() is None, native.unsupported_torch()


def test_an_older_torch_is_refused_at_import_and_a_newer_one_warned_about(monkeypatch):
    monkeypatch.setattr(native.torch, "__version__", "2.9.1")
    with pytest.raises(ImportError, match=r"supports torch>=2\.10,<2\.16 .* runs torch 2\.9\.1\. Install"):
        native.check_torch()
    monkeypatch.setattr(native.torch, "__version__", "2.16.0.dev20261201")
    with pytest.warns(UserWarning, match="newer than the package was tested with"):
        native.check_torch()


def test_the_cxx_standard_is_the_running_torchs():
    source = (Path(torch.__file__).parent / "utils" / "cpp_extension.py").read_text()
    std = targets.cxx_standard(source)
    assert std in ("-std=c++17", "-std=c++20", "-std=c++23")
    flags = build.compile_flags(targets.core(ROOT / "csrc"))
    assert [f for f in flags if f.startswith("-std=")] == [std]
    # both places cpp_extension states it: the setup() default and the JIT build's flags
    assert targets.cxx_standard("cpp_flag = cpp_flag_prefix + 'c++17'") == "-std=c++17"
    assert targets.cxx_standard("cflags = common_cflags + ['-fPIC', '-std=c++20'] + extra") == "-std=c++20"
    with pytest.raises(LookupError):
        targets.cxx_standard("no standard here")


@pytest.fixture
def fresh(monkeypatch):
    native.load_launcher.cache_clear()
    monkeypatch.delitem(sys.modules, "torch_metal_flash._C", raising=False)
    yield monkeypatch
    native.load_launcher.cache_clear()


def test_a_prebuilt_C_for_another_torch_minor_is_refused_unimported(fresh):
    running = targets.torch_minor(torch.__version__)
    other = f"{running[0]}.{running[1] - 1}.2"
    fresh.setattr(native, "build_info", lambda: {"torch": other, "extension": True})
    imported = []
    real_import = native.importlib.import_module
    fresh.setattr(native.importlib, "import_module",
                  lambda name, *a: imported.append(name) or real_import(name, *a))
    why = metal.unavailable_reason(MPS)
    assert imported == [], "a _C built for another torch minor must not even be imported"
    assert f"built for torch {other} and this process runs torch {torch.__version__}" in why
    assert native.REBUILD in why


def test_only_the_minor_decides():
    record = {"torch": "2.15.1", "extension": True}
    assert native.stale_build(record, running="2.15.0+cu132") is None
    assert "built for torch 2.15.1" in native.stale_build(record, running="2.14.1")
    assert native.stale_build({"torch": "2.14.1", "extension": "not built"}, running="2.15.0") is None


def test_on_macos_a_refused_C_is_built_at_first_use_against_the_running_torch(fresh):
    fresh.setattr(native, "build_info", lambda: {"torch": "2.10.0", "extension": True})
    fresh.setattr(native, "_cannot_build_reason", lambda: None)
    fresh.setattr(sys, "platform", "darwin")
    built = object()
    fresh.setattr(build, "load_launcher", lambda: built)
    assert native.load_launcher() == (built, None)


def test_a_failed_first_use_build_is_reported_with_its_first_line(fresh):
    fresh.setattr(native, "build_info", lambda: {"torch": "2.10.0", "extension": True})
    fresh.setattr(native, "_cannot_build_reason", lambda: None)
    fresh.setattr(sys, "platform", "darwin")

    def fail():
        raise RuntimeError("compiling torch_metal_flash._C (launcher.mm) failed:\nlauncher.mm:1: error: x")
    fresh.setattr(build, "load_launcher", fail)
    module, why = native.load_launcher()
    assert module is None
    assert "built for torch 2.10.0" in why and "building it at first use against torch" in why
    assert "launcher.mm) failed:" in why and "error: x" not in why and native.REBUILD in why


def test_the_first_use_launcher_build_compiles_the_launcher_target():
    """What setup.py prebuilds and bench/macos_cross_build.py cross-checks is this same target."""
    import runpy
    setup = runpy.run_path(str(ROOT / "setup.py"), run_name="tmf_setup")
    target = targets.launcher(ROOT / "csrc")
    args = setup["macos_extension_args"]()
    assert args["sources"] == [f"csrc/{s}" for s in target.sources]
    assert args["extra_compile_args"]["cxx"] == list(target.compile_flags)
    flags = build.compile_flags(target)
    assert "-DTORCH_EXTENSION_NAME=_C" in flags and set(target.compile_flags) <= set(flags)


def test_a_core_build_failing_under_a_torch_outside_the_range_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(native.torch, "__version__", "2.16.0")
    monkeypatch.setattr(native, "launcher", lambda: None)

    def fail():
        raise RuntimeError("compiling torch_metal_flash._tmf_core (core.cpp) failed:\n" + "core.cpp:1: error\n" * 50)
    monkeypatch.setattr(build, "load_core", fail)
    with pytest.raises(RuntimeError) as info:
        native.core_extension()
    message = str(info.value)
    assert message.startswith("torch_metal_flash supports torch>=2.10,<2.16") and "\n" not in message
    assert "(building the C++ op core against it failed: compiling torch_metal_flash._tmf_core" in message
