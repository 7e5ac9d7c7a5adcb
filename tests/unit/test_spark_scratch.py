"""Spark's scratch directories: one per driver process, locked while it runs, removed by the
next driver to start once their own has died (kill -9 included)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_engine.spark import scratch

ROOT = Path(__file__).resolve().parents[2]

# A driver: takes its scratch directory, says where, and waits to be killed.
DRIVER = (
    "import sys, time\n"
    "from queue_engine.spark import scratch\n"
    "print(scratch.local_dir(), flush=True)\n"
    "time.sleep(600)\n"
)


def driver(tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    env.pop("SPARK_LOCAL_DIRS", None)
    process = subprocess.Popen(
        [sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line and line != "None", line
    return process, Path(line)


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("SPARK_LOCAL_DIRS", raising=False)
    monkeypatch.setattr(scratch, "_held", None)
    # tempfile caches the directory it chose.
    monkeypatch.setattr("tempfile.tempdir", None)
    yield tmp_path
    if scratch._held is not None:
        os.close(scratch._held[1])


def test_a_killed_drivers_files_are_removed_and_a_running_ones_kept(tmp: Path) -> None:
    killed, killed_dir = driver(tmp)
    running, running_dir = driver(tmp)
    try:
        assert killed_dir.parent == running_dir.parent == scratch.root()
        assert killed_dir != running_dir
        (killed_dir / "spark-1" / "userFiles-1").mkdir(parents=True)
        (killed_dir / "spark-1" / "userFiles-1" / "delta.jar").write_bytes(b"x" * 4096)
        (running_dir / "blockmgr-1").mkdir()
        killed.kill()
        killed.wait(10)

        mine = scratch.local_dir()
        assert mine is not None
        assert not killed_dir.exists()
        assert (running_dir / "blockmgr-1").is_dir()
        assert sorted(p.name for p in scratch.root().iterdir()) == sorted(
            [running_dir.name, Path(mine).name]
        )
        # The same process asks again: the same directory, not a second one.
        assert scratch.local_dir() == mine
    finally:
        running.kill()
        running.wait(10)
    # Once that driver is gone too, its directory goes with the next sweep; this process's
    # own stays while it holds it.
    assert scratch.sweep(scratch.root()) == [running_dir]
    assert [p.name for p in scratch.root().iterdir()] == [Path(mine).name]


def test_a_directory_without_its_lock_is_removed_only_once_old(tmp: Path) -> None:
    parent = scratch.root()
    parent.mkdir(mode=0o700)
    young, old = parent / "1-young", parent / "2-old"
    young.mkdir()
    old.mkdir()
    then = time.time() - scratch.UNLOCKED_GRACE_S - 60
    os.utime(old, (then, then))
    assert scratch.sweep(parent) == [old]
    assert young.is_dir()


def test_spark_local_dirs_set_by_the_user_is_left_to_spark(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp / "mine"))
    assert scratch.local_dir() is None
    assert not scratch.root().exists()


def test_a_parent_others_can_write_to_is_not_used(tmp: Path) -> None:
    parent = scratch.root()
    parent.mkdir()
    parent.chmod(0o777)
    assert scratch.local_dir() is None
    assert list(parent.iterdir()) == []
