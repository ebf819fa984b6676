"""scripts/setup.sh (run by demo.sh and test.sh) installs only when .venv is not current for the extra asked.

The real script runs under bash in a scratch copy of the repository's set-up files; `.venv/bin/python` there is a
stand-in that logs its arguments instead of running pip, so the test needs no network and takes milliseconds.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../../pip.log"
if [ -e "$(dirname "$0")/../../fail-install" ] && [ "$1 $2 $3" = "-m pip install" ] && [ "$5" = "-e" ]; then exit 1; fi
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def run_setup(checkout: Path, *extra: str) -> list[str]:
    """Run setup.sh; the pip commands it ran."""
    log = checkout / "pip.log"
    before = log.read_text().splitlines() if log.exists() else []
    proc = subprocess.run(["bash", "scripts/setup.sh", *extra], cwd=checkout, capture_output=True, text=True,
                          timeout=30)
    after = log.read_text().splitlines() if log.exists() else []
    assert proc.returncode == 0, proc.stderr
    return after[len(before):]


def test_installs_once_per_extra_and_again_when_pyproject_changes(checkout):
    first = run_setup(checkout)
    assert first and first[-1] == "-m pip install --quiet -e ."
    assert run_setup(checkout) == []  # current: no pip at all
    with_tests = run_setup(checkout, "test")
    assert with_tests and with_tests[-1] == "-m pip install --quiet -e .[test]"
    assert run_setup(checkout, "test") == [] and run_setup(checkout) == []
    with (checkout / "pyproject.toml").open("a") as f:
        f.write("\n# a changed dependency\n")
    assert run_setup(checkout)[-1] == "-m pip install --quiet -e ."
    assert run_setup(checkout, "test")[-1] == "-m pip install --quiet -e .[test]"


def test_a_failed_install_leaves_no_stamp_so_the_next_run_retries(checkout):
    (checkout / "fail-install").touch()
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert not list((checkout / ".venv").glob(".kvobs-setup-*"))
    (checkout / "fail-install").unlink()
    assert run_setup(checkout)[-1] == "-m pip install --quiet -e ."
    assert run_setup(checkout) == []


def test_force_reinstalls(checkout, monkeypatch):
    run_setup(checkout)
    monkeypatch.setenv("KVOBS_SETUP_FORCE", "1")
    assert run_setup(checkout)[-1] == "-m pip install --quiet -e ."
