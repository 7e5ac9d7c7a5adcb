"""ruff over the project and mypy --strict over queue_engine/: CI fails if either complains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_ruff_clean() -> None:
    result = _run("ruff", "check", "queue_engine", "api", "jobs", "deltaq", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_on_queue_engine() -> None:
    result = _run("mypy", "--strict", "queue_engine", "api", "deltaq", "jobs")
    assert result.returncode == 0, result.stdout + result.stderr
