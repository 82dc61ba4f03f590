"""The test suite imports beside an installed top-level package named ``tests`` (issue 38).

LeRobot depends on ``draccus``, whose wheel installs a top-level ``tests`` package. While
dmuon's ``tests/`` was a namespace directory, any regular package of that name anywhere on
``sys.path`` won the import, so the conftest died on ``ModuleNotFoundError: No module named
'tests._pool'`` and scripts that import ``tests.models`` did too. Each check here puts such an
impostor on ``PYTHONPATH`` and runs a fresh interpreter the way users do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def impostor_env(tmp_path: Path) -> dict[str, str]:
    """Environment whose ``PYTHONPATH`` holds a regular package ``tests`` without our modules."""
    pkg = tmp_path / "site" / "tests"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("IMPOSTOR = True\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pkg.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.mark.compat
def test_pytest_collects_beside_an_installed_tests_package(impostor_env):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         "tests/test_pool.py"],
        cwd=REPO, env=impostor_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "No module named 'tests." not in proc.stdout + proc.stderr
    assert " collected" in proc.stdout or "tests collected" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.compat
def test_a_script_imports_the_test_models_beside_an_installed_tests_package(impostor_env, tmp_path):
    # What bench/ scripts do: put the checkout first on sys.path, then import tests.models.
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import tests, tests.models\n"
        "print(tests.__file__)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=impostor_env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).resolve() == REPO / "tests" / "__init__.py", proc.stdout
