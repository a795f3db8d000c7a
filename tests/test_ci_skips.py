"""Under ``CI=true`` a skip for a reason CI does not allow fails (conftest.CI_SKIPS):
in a test, and for a module skipped whole at collection."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_TESTS = {
    "test_in_test.py": "import pytest\n\ndef test_a():\n    pytest.skip('no broker here')\n",
    "test_at_collection.py": "import pytest\n\npytest.importorskip('no_such_module_xyz')\n\n"
                             "def test_b():\n    pass\n",
    "test_allowed.py": "import pytest\n\ndef test_c():\n    pytest.skip('x declares "
                       "delay UNSUPPORTED')\n",
}


def _run(tmp_path: Path, ci: str) -> str:
    for name, text in _TESTS.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "CI": ci}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-rfEs", "-p", "no:randomly",
         "-p", "no:cacheprovider", "--continue-on-collection-errors", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_in_ci_a_disallowed_skip_fails_in_a_test_and_at_collection(tmp_path: Path) -> None:
    out = _run(tmp_path, "true")
    assert "test_in_test.py::test_a - CI=true: skipped" in out, out
    assert "ERROR " in out and "test_at_collection.py skipped for a reason" in out, out
    assert "1 skipped" in out, out  # the allowed reason stays a skip


def test_outside_ci_they_stay_skips(tmp_path: Path) -> None:
    out = _run(tmp_path, "")
    assert "3 skipped" in out and "failed" not in out and "error" not in out, out
