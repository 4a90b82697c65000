"""The macOS workflow (.github/workflows/macos.yml) parses and runs the Mac path:
the README's install command, every shader through Apple's compiler with
-Werror, every pipeline specialised, the MPS tests and the doctor."""
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
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
    assert "tests/test_mps.py" in steps["MPS tests"]["run"]
    assert "python -m torch_metal_flash doctor" in steps["Doctor"]["run"]
    for name in ("MPS tests", "Doctor"):
        assert steps[name]["if"] == "steps.mps.outputs.usable == 'true'"
        assert steps[name]["working-directory"] == "${{ runner.temp }}", "the installed package, not the checkout"
    assert "build_info()" in steps["Precompiled shaders shipped"]["run"]
