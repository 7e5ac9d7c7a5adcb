"""The Spark driver's class archive: built in the background for the first session that finds
none, mapped by the sessions after it, and dropped (the session still starting) when damaged."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from queue_engine.spark import class_archive
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# A session in a fresh interpreter, as every deltaq command starts one: whether its JVM maps
# a class archive (the archive file among the JVM's memory mappings).
SESSION = """
import json, sys
from queue_engine.spark.session import build_session
spark = build_session(app_name="archive-probe", delta_spark=False, quiet=True)
assert spark.range(3).count() == 3
pid = spark._jvm.java.lang.ProcessHandle.current().pid()
with open(f"/proc/{pid}/maps") as f:
    mapped = sorted({line.split()[-1] for line in f if line.rstrip().endswith(".jsa")})
print(json.dumps({"mapped": mapped}))
spark.stop()
"""


def session(env: dict[str, str]) -> tuple[list[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", SESSION],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return [m for m in answer["mapped"] if "spark-classes-" in m], done.stderr


@pytest.mark.timeout(600)
def test_sessions_map_the_archive_built_for_them_and_start_without_a_damaged_one(
    tmp_path: Path,
) -> None:
    if not Path("/proc/self/maps").exists():
        pytest.skip("reads a JVM's memory mappings from /proc")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    env.pop("DELTAQ_SPARK_CLASS_ARCHIVE", None)
    built = class_archive.archive_path()
    assert built is not None
    # This machine's archive: built in the background by the first session that found none
    # (this test's, or an earlier one's).
    if not built.is_file():
        session(env)
    _wait_for_build(built)

    # A cache of its own, holding a copy: the sessions below map it, then find it damaged.
    cache = tmp_path / "cache"
    archive = cache / "deltaq" / built.name
    archive.parent.mkdir(parents=True)
    shutil.copyfile(built, archive)
    env["XDG_CACHE_HOME"] = str(cache)
    mapped, _ = session(env)
    assert [os.path.realpath(m) for m in mapped] == [os.path.realpath(archive)]

    # Torn (as a disk could leave a file nobody fsync'd): the JVM would crash mapping it.
    in_cwd = set(ROOT.glob("hs_err_pid*.log"))
    os.truncate(archive, archive.stat().st_size // 3)
    mapped, stderr = session(env)
    assert mapped == []
    assert "Spark did not start with its class archive; starting without it" in stderr
    assert not archive.exists()
    assert list(archive.parent.glob("hs_err_*.log"))  # its crash report, not in the cwd
    assert set(ROOT.glob("hs_err_pid*.log")) == in_cwd
    # Not rebuilt at once: a machine where the archive crashes a JVM does not build one at
    # every start.
    assert archive.with_suffix(".failed").exists()
    assert not archive.with_suffix(".log").exists()


def _wait_for_build(archive: Path) -> None:
    """Until ``archive`` exists and its build is over (its lock free)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if archive.is_file():
            fd = os.open(archive.with_suffix(".building"), os.O_CREAT | os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
        time.sleep(1)
    log = archive.with_suffix(".log")
    raise TimeoutError(f"no class archive was built: {log.read_text() if log.exists() else ''}")
