"""The declared interfaces type-check: mypy (pinned in pyproject.toml's dev extra) over the files its
[tool.mypy] section lists. A cold run reads torch's stubs (about a minute here), so it is in the slow tier."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_interfaces_type_check():
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found in 20 source files" in run.stdout
