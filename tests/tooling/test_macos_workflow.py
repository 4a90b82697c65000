"""The macOS workflow (.github/workflows/macos.yml) parses and runs the Mac path:
the README's install command, every shader through Apple's compiler with
-Werror, every pipeline specialised, the MPS tests and the doctor."""
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"

if not WORKFLOW.is_file():
    pytest.skip("workflow tests run from a source checkout", allow_module_level=True)


def readme_mac_install() -> str:
    """The install half of the README's Mac command
    (`pip install ... && (cd ~ && python -m torch_metal_flash doctor)`: outside the checkout)."""
    (line,) = [x for x in (ROOT / "README.md").read_text().splitlines()
               if x.startswith("pip install") and x.endswith("&& (cd ~ && python -m torch_metal_flash doctor)")]
    return line.split(" && ")[0]


def test_workflow_parses_and_names_the_mac_steps():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert {"push", "pull_request"} <= set(triggers)
    (job,) = workflow["jobs"].values()
    assert job["runs-on"].startswith("macos-")
    steps = {s["name"]: s for s in job["steps"] if "name" in s}

    assert steps["Install (the README's Mac command)"]["run"].strip() == readme_mac_install()
    offline = steps["Compile every shader offline (-Werror)"]["run"]
    assert all(flag in offline for flag in ("xcrun -sdk macosx metal", "shaders/*.metal", "-std=metal3.1",
                                            "-Werror"))
    specialise = steps["Specialise every pipeline the planners emit (function constants)"]
    assert "python -m torch_metal_flash doctor --skip probes,timing" in specialise["run"]
    assert "tests/kernels/test_mps.py" in steps["MPS tests"]["run"]
    assert "python -m torch_metal_flash doctor" in steps["Doctor"]["run"]
    for name in ("MPS tests", "Doctor"):
        assert steps[name]["if"] == "steps.mps.outputs.usable == 'true'"
        assert steps[name]["working-directory"] == "${{ runner.temp }}", "the installed package, not the checkout"
    assert "build_info()" in steps["Precompiled shaders shipped"]["run"]
    assert "native.load_launcher()" in steps["The launcher builds at first use against the installed torch"]["run"]


RELEASE = ROOT / ".github" / "workflows" / "release.yml"


def _declared_torch_minors() -> list:
    """Every torch minor the runtime dependency of pyproject.toml admits (e.g. >=2.10,<2.16: 2.10 ... 2.15)."""
    import tomllib

    from packaging.requirements import Requirement
    (torch_req,) = [r for r in map(Requirement, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                                   ["dependencies"]) if r.name == "torch"]
    return [f"2.{m}" for m in range(40) if f"2.{m}.0" in torch_req.specifier]


def test_release_workflow_builds_a_wheel_per_declared_torch_and_tests_it():
    workflow = yaml.safe_load(RELEASE.read_text())
    (job,) = workflow["jobs"].values()
    assert job["runs-on"].startswith("macos-")
    assert job["strategy"]["matrix"]["torch"] == _declared_torch_minors() == [f"2.{m}" for m in range(10, 16)]
    steps = {s.get("name", s.get("uses")): s for s in job["steps"]}
    build = steps["Build the wheel against torch ${{ matrix.torch }}"]["run"]
    assert '"torch==${{ matrix.torch }}.*"' in build and "--no-build-isolation" in build
    assert "xcrun -sdk macosx metal" in steps["Metal toolchain"]["run"]
    check = steps["The wheel holds _C built against torch ${{ matrix.torch }}"]["run"]
    assert "_build_info.json" in check and 'record["extension"] is True' in check
    install = steps["Install the wheel with its torch (outside the checkout)"]
    assert install["working-directory"] == "${{ runner.temp }}" and "dist/*.whl" in install["run"]
    assert "torch_metal_flash doctor" in steps["Doctor"]["run"]
    assert "tests/kernels/test_mps.py" in steps["MPS tests"]["run"]
    for name in ("Doctor", "MPS tests"):
        assert steps[name]["if"] == "steps.mps.outputs.usable == 'true'"
    upload = steps["actions/upload-artifact@v7"]["with"]
    assert upload["name"].endswith("torch${{ matrix.torch }}") and "dist/*.whl" in upload["path"]
