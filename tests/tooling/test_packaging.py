"""Installing: ``pip install .`` with pip's default build isolation.

* Linux: an sdist and a wheel built from it in isolated environments: a pure
  Python wheel with the shaders and runtime sources, no torch in the build env.
* macOS, driven here with ``sys.platform`` patched: ``setup.py build_py``
  finds the launcher source and the shaders, compiles a ``.metallib`` per
  shader through ``xcrun`` (a recording stand-in here), writes the build
  record, and imports nothing that the darwin build requirements in
  ``pyproject.toml`` do not provide: remove torch from them and this fails.
"""
import importlib.metadata
import json
import os
import re
import runpy
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DARWIN = dict(default_environment(), sys_platform="darwin", platform_system="Darwin", extra="")

if not (ROOT / "setup.py").is_file():
    pytest.skip("packaging tests run from a source checkout", allow_module_level=True)


def _run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert result.returncode == 0, \
        f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An sdist, and a wheel built from it, both with pip's default build isolation: (sdist, wheel, pip's log)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(ROOT)])
    (sdist,) = out.glob("*.tar.gz")
    result = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-cache-dir", "-w", str(out),
                   str(sdist)])
    (wheel,) = out.glob("*.whl")
    return sdist, wheel, result.stdout + result.stderr


def test_sdist_and_wheel_build_with_default_isolation(built):
    sdist, wheel, log = built
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "csrc/metal/launcher.mm", "shaders/flash_fwd.metal"} <= names

    assert "Installing build dependencies" in log
    assert not re.search(r"Collecting torch\b", log), "a Linux build must not pull torch into its environment"
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    files = set(zipfile.ZipFile(wheel).namelist())
    shaders = {f"torch_metal_flash/shaders/{p.name}" for p in (ROOT / "shaders").iterdir()}
    assert shaders <= files
    assert {"torch_metal_flash/_csrc/emulator/runtime.cpp", "torch_metal_flash/_csrc/metal/launcher.mm"} <= files
    # every source of the emulator runtime (one translation unit over runtime/) and of its shim
    emulator_sources = {f"torch_metal_flash/_csrc/{p.relative_to(ROOT / 'csrc').as_posix()}"
                        for p in (ROOT / "csrc" / "emulator").rglob("*") if p.is_file()}
    assert emulator_sources <= files, sorted(emulator_sources - files)
    assert not any("/_C." in f or f.endswith(".metallib") for f in files)
    record = json.loads(zipfile.ZipFile(wheel).read("torch_metal_flash/_build_info.json"))
    assert record["platform"] == sys.platform and record["torch"] is None


def test_installed_wheel_runs_the_demo_in_the_emulator(built, tmp_path):
    """The installed layout (csrc/ ships as _csrc/) through the emulator's checks, outside the checkout: the
    shim's own code must stay exempt from the rules for user code (a function pointer in the shim, judged
    as user code, fails every kernel compile of an installed package while the checkout's tests pass)."""
    site = tmp_path / "site"
    zipfile.ZipFile(built[1]).extractall(site)  # a pure-Python wheel: unpacking it is installing it
    env = dict(os.environ, PYTHONPATH=str(site), TORCH_METAL_FLASH_CACHE_DIR=str(tmp_path / "cache"))
    result = _run([sys.executable, "-m", "torch_metal_flash", "--quick"], cwd=tmp_path, env=env)
    assert f"{site}/torch_metal_flash" in _run([sys.executable, "-c", "import torch_metal_flash as t; print(t.__file__)"],
                                               cwd=tmp_path, env=env).stdout
    assert "all results within the float64-oracle budget" in result.stdout
    assert "'emulator': 2" in result.stdout, result.stdout


FAKE_XCRUN = '''#!{python}
"""Records its arguments; makes the files `metal -c ... -o X` and `metallib A -o B` would make."""
import os, sys
args = sys.argv[1:]
with open(os.environ["XCRUN_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
assert args[:2] == ["-sdk", "macosx"], args
tool, rest = args[2], args[3:]
if rest == ["--version"]:
    print("Apple metal version 32023.404 (metalfe-32023.404)")
    sys.exit(0)
if os.environ.get("XCRUN_REJECT") and any(a.startswith(os.environ["XCRUN_REJECT"]) for a in rest):
    sys.exit("error: unknown argument: '" + os.environ["XCRUN_REJECT"] + "'")
out = rest[rest.index("-o") + 1]
if tool == "metal":
    src = rest[rest.index("-c") + 1]
    assert src.endswith(".metal") and os.path.isfile(src), src
open(out, "w").write(tool + "\\n")
'''


@pytest.fixture
def xcrun(tmp_path, monkeypatch):
    """A stand-in ``xcrun`` first on PATH; returns the path of its argument log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "xcrun"
    script.write_text(FAKE_XCRUN.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "xcrun.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XCRUN_LOG", str(log))
    monkeypatch.delenv("TORCH_METAL_FLASH_METALLIB", raising=False)
    return log


DRIVER = textwrap.dedent('''
    """setup.py build_py as on a Mac, in an environment holding only the stdlib and
    the distributions named in argv[2] (the declared darwin build requirements and
    what they install): any other import fails as it would in pip's isolated build."""
    import json, re, runpy, site, sys, sysconfig
    from importlib.abc import MetaPathFinder
    from importlib.machinery import PathFinder
    from importlib.metadata import packages_distributions

    allowed = set(json.loads(sys.argv[2]))
    dists = packages_distributions()
    site_dirs = set(site.getsitepackages() + [site.getusersitepackages()])

    class BuildEnvironment(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if "." in name or name in sys.builtin_module_names:
                return None
            if any(re.sub(r"[-_.]+", "-", d).lower() in allowed for d in dists.get(name, ())):
                return None
            # not installed there: only the stdlib, or a copy vendored inside an allowed package
            spec = PathFinder.find_spec(name, [p for p in sys.path if p not in site_dirs])
            if spec is None:
                raise ModuleNotFoundError(f"No module named {name!r} (not a darwin build requirement)", name=name)
            return spec

    sys.meta_path.insert(0, BuildEnvironment())
    sysconfig.get_config_vars()  # before the platform is patched: on darwin it reads macOS-only modules
    import urllib.request  # noqa: F401 -- likewise (on darwin: _scproxy)
    try:
        import torch
        torch.backends.mps.is_built = lambda: True
    except ModuleNotFoundError:
        pass  # pip's isolated build: torch is no build requirement
    sys.platform = "darwin"
    sys.argv = ["setup.py", "build_py", "--build-lib", sys.argv[1]]
    runpy.run_path("setup.py", run_name="__main__")
''')


def _declared_closure() -> set:
    """The darwin build requirements and, transitively, what they install (from this environment's metadata)."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    todo = [r for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate(DARWIN)]
    seen = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            deps = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [d for d in map(Requirement, deps) if d.marker is None or d.marker.evaluate(DARWIN)]
    return seen


def test_macos_build_finds_what_it_needs_and_declares_what_it_imports(tmp_path, xcrun):
    build_lib = tmp_path / "build"
    _run([sys.executable, "-c", DRIVER, str(build_lib), json.dumps(sorted(_declared_closure()))], cwd=ROOT)

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not [r for r in map(Requirement, pyproject["build-system"]["requires"]) if r.name == "torch"], \
        "_C runs only with the torch it was built against: it is built at first use, not in the build environment"

    package = build_lib / "torch_metal_flash"
    record = json.loads((package / "_build_info.json").read_text())
    stems = sorted(p.stem for p in (ROOT / "shaders").glob("*.metal"))
    nax_stems = [s for s in stems if s.endswith("_nax")]  # MSL 4.0 (the stand-in compiler takes it)
    assert record["torch"] is None and record["extension"].startswith("not prebuilt (no torch at build time)")
    assert record["metallib"] == {"files": [f"{s}.metallib" for s in stems if s not in nax_stems], "std": "metal3.1",
                                  "macos_min": "14.0", "math_mode": "safe",
                                  "nax": {"files": [f"{s}.metallib" for s in nax_stems], "std": "metal4.0",
                                          "macos_min": "26.2"},
                                  "compiler": "Apple metal version 32023.404 (metalfe-32023.404)"}
    assert all((package / "shaders" / f"{s}.metallib").is_file() for s in stems)
    compiles = [line.split() for line in xcrun.read_text().splitlines() if " -c " in line and "probe" not in line]
    assert sorted(Path(c[c.index("-c") + 1]).stem for c in compiles) == stems
    for c in compiles:
        nax = Path(c[c.index("-c") + 1]).stem in nax_stems
        std, macos_min = ("metal4.0", "26.2") if nax else ("metal3.1", "14.0")
        assert {f"-std={std}", f"-mmacosx-version-min={macos_min}"} <= set(c)
        assert "-fno-fast-math" in c  # the launcher's one math mode
    # the probe of the MSL 4.0 flags uses exactly the real compile's flags
    (probe,) = [line.split() for line in xcrun.read_text().splitlines() if "probe.metal" in line]
    (nax_compile,) = [c for c in compiles if Path(c[c.index("-c") + 1]).stem == nax_stems[0]]
    assert set(probe) - {probe[probe.index("-c") + 1], probe[probe.index("-o") + 1]} <= set(nax_compile)


@pytest.fixture
def setup_py(monkeypatch):
    import sysconfig
    sysconfig.get_config_vars()  # as on Linux first: on darwin these read macOS-only modules
    import setuptools  # noqa: F401
    import torch  # noqa: F401
    monkeypatch.setattr(sys, "platform", "darwin")
    return runpy.run_path(str(ROOT / "setup.py"), run_name="tmf_setup")


def test_extension_is_the_launcher_when_torch_has_mps(setup_py, monkeypatch):
    import torch
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    (ext,), cmdclass, version, note = setup_py["extension"]()
    assert ext.name == "torch_metal_flash._C" and all(Path(s).is_file() for s in ext.sources)
    assert "build_ext" in cmdclass and version == torch.__version__ and note is True
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    assert setup_py["extension"]()[3] == f"torch {torch.__version__} was built without MPS"


def test_metallib_step_without_a_toolchain_or_when_told(setup_py, monkeypatch, tmp_path, xcrun):
    step = setup_py["metallib_step"]
    shaders = ROOT / "shaders"
    monkeypatch.setenv("TORCH_METAL_FLASH_METALLIB", "0")
    assert step(shaders, tmp_path) == "skipped (TORCH_METAL_FLASH_METALLIB=0)"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # Command Line Tools only: no metal
    monkeypatch.setenv("TORCH_METAL_FLASH_METALLIB", "auto")
    assert "`xcrun -sdk macosx metal` is not available" in step(shaders, tmp_path)
    monkeypatch.setenv("TORCH_METAL_FLASH_METALLIB", "1")
    with pytest.raises(RuntimeError, match="TORCH_METAL_FLASH_METALLIB=1"):
        step(shaders, tmp_path)
    monkeypatch.setenv("TORCH_METAL_FLASH_METALLIB", "yes")
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        step(shaders, tmp_path)
    assert not list(tmp_path.glob("*.metallib"))


def test_metallib_math_mode_falls_back_to_safe_and_errors_carry_the_log(setup_py, monkeypatch, tmp_path, xcrun):
    monkeypatch.setenv("XCRUN_REJECT", "-fmetal-math-mode")
    record = setup_py["metallib_step"](ROOT / "shaders", tmp_path)
    assert record["math_mode"] == "safe"
    assert all("-fno-fast-math" in line for line in xcrun.read_text().splitlines() if "-std=metal3.1" in line)
    monkeypatch.setenv("XCRUN_REJECT", "-std=metal3.1")
    with pytest.raises(RuntimeError, match="(?s)unknown argument: '-std=metal3.1'.*TORCH_METAL_FLASH_METALLIB=0"):
        setup_py["metallib_step"](ROOT / "shaders", tmp_path)


def _shader_folder(tmp_path):
    """A shader folder with one classic and one neural-accelerator source."""
    shaders = tmp_path / "shaders"
    shaders.mkdir()
    for name in ("a.metal", "b_nax.metal"):
        (shaders / name).write_text("kernel void k() {}\n")
    return shaders


def test_nax_sources_are_msl4_for_macos_26_2(setup_py, tmp_path, xcrun):
    shaders = _shader_folder(tmp_path)
    record = setup_py["metallib_step"](shaders, shaders)
    assert record["files"] == ["a.metallib"] and record["std"] == "metal3.1"
    assert record["nax"] == {"files": ["b_nax.metallib"], "std": "metal4.0", "macos_min": "26.2"}
    (nax_compile,) = [line.split() for line in xcrun.read_text().splitlines() if "b_nax.metal -o" in line]
    assert {"-std=metal4.0", "-mmacosx-version-min=26.2", "-fno-fast-math"} <= set(nax_compile)
    assert not any("-std=metal4.0" in line for line in xcrun.read_text().splitlines() if "a.metal " in line)


def test_nax_sources_are_left_to_run_time_where_the_sdk_lacks_msl4(setup_py, monkeypatch, tmp_path, xcrun):
    monkeypatch.setenv("XCRUN_REJECT", "-std=metal4.0")  # an SDK before macOS 26
    shaders = _shader_folder(tmp_path)
    record = setup_py["metallib_step"](shaders, shaders)
    assert record["files"] == ["a.metallib"]
    assert record["nax"].startswith("not precompiled: this Metal compiler does not take -std=metal4.0 "
                                    "-mmacosx-version-min=26.2")
    assert (shaders / "a.metallib").is_file() and not (shaders / "b_nax.metallib").exists()
    assert not any("b_nax.metal" in line for line in xcrun.read_text().splitlines())
