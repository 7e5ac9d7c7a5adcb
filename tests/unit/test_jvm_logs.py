"""Local drivers' JVM logs: the newest are kept, older ones go, a running process's stays."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from queue_engine.spark.session import JVM_LOGS_KEPT, jvm_log_path


def test_a_starting_driver_keeps_the_newest_logs_and_those_of_running_processes(
    tmp_path: Path,
) -> None:
    # Pids of processes that have exited (reaped): their logs may go.
    dead = []
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        dead.append(p.pid)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = [f"jvm-{4_000_000 + i}.log" for i in range(JVM_LOGS_KEPT + 10)]
        for age, name in enumerate(names):  # names[0] the newest
            path = tmp_path / name
            path.write_text("x")
            os.utime(path, (1_000_000 - age, 1_000_000 - age))
        oldest = {f"jvm-{pid}.log" for pid in dead} | {f"jvm-{running.pid}.log"}
        for name in oldest:
            (tmp_path / name).write_text("x")
            os.utime(tmp_path / name, (1, 1))
        (tmp_path / "notes.txt").write_text("not a log")

        mine = jvm_log_path(str(tmp_path))

        assert mine == str(tmp_path / f"jvm-{os.getpid()}.log")
        left = {p.name for p in tmp_path.iterdir()}
        assert left == set(names[:JVM_LOGS_KEPT]) | {f"jvm-{running.pid}.log", "notes.txt"}
    finally:
        running.kill()
        running.wait()
