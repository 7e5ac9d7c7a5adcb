"""A class-data archive of the Spark driver's JVM (the JDK's application class-data sharing,
CDS): the classes a Spark + delta-spark session loads, parsed and verified once and mapped from
a file by every later JVM.

A Spark driver's JVM spends most of its first seconds loading and verifying ~20,000 classes:
on two cores a local session with delta-spark took ~9.5 s of CPU to start and ~14 s to run its
first Delta query. Mapped from an archive, the same took ~5.7 s and ~8 s of CPU, ~3 s less
wall time to start (``deltaq up``, ``deltaq sql``, every job).

The archive is made once a machine (per java and pyspark install) by a detached process that
runs a small session under ``-XX:ArchiveClassesAtExit``, in the background of the first session
that finds none: dumping costs its JVM ~20 s more than an ordinary run, which no command a user
waits on should pay. The archive is written to a temporary name, fsync'd and renamed into place
only once its JVM has exited cleanly: a torn archive crashes the JVM that maps it, so no session
may ever see a partial one (a power cut included). A session whose JVM still crashes mapping
it removes it and starts without (``session._start``). A build that fails, or an archive a JVM
crashed on, is not tried again for FAILED_RETRY_S: the archive only saves time, and a machine
where it cannot work should not pay for a build at every start.

Only a local master's driver maps it (a cluster's driver keeps its ``spark-defaults.conf``
options), and never a driver spark-submit started (its JVM was running before this code).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from queue_engine.spark.java import java_executable

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

# Unset or "1": use the archive, making it when absent; "0": neither.
ENV = "DELTAQ_SPARK_CLASS_ARCHIVE"
# How long a build may take in all (a build takes ~1 min on two cores).
BUILD_TIMEOUT_S = 600.0
# After a failed build, or a JVM that crashed on an archive: no new build for this long.
FAILED_RETRY_S = 86_400.0
# The crash report of a driver JVM started with the archive (one name per start).
_CRASH_REPORT = "hs_err_{nonce}_pid%p.log"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def archive_path() -> Path | None:
    """Where the archive of this java and pyspark install is (whether it exists or not);
    None where there is no java to key it by, or the path holds whitespace (Spark splits a
    JVM's options on it)."""
    java, _ = java_executable()
    if java is None:
        return None
    import pyspark

    real = os.path.realpath(java)
    home = Path(real).parent.parent
    jars = Path(pyspark.__file__).parent / "jars"
    key = hashlib.sha256()
    try:
        st = os.stat(real)
        key.update(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{jars}\0".encode())
        with contextlib.suppress(OSError):
            # The JDK's own record of its version: a java behind a shim is told apart too.
            key.update((home / "release").read_bytes())
        for jar in sorted(jars.iterdir()):
            # Its time too: a JVM maps an archive only if every jar on its class path has the
            # time it had at the dump, so pyspark reinstalled in place needs a new archive.
            st = jar.stat()
            key.update(f"{jar.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (OSError, RuntimeError):
        return None
    path = cache / "deltaq" / f"spark-classes-{key.hexdigest()[:16]}.jsa"
    return None if any(c.isspace() for c in str(path)) else path


def java_options() -> str:
    """The local driver JVM's options that map the archive, or "" (and, where there is none
    yet, a detached build of it is started unless one is under way or failed lately). Never
    raises: the archive only saves time."""
    if not enabled():
        return ""
    try:
        path = archive_path()
        if path is None:
            return ""
        if path.is_file():
            # The JVM logs nothing about the archive: an archive it cannot use (another JVM
            # build behind the same path) only costs the time it saves. A JVM that cannot
            # map a damaged archive crashes before Spark starts: its crash report goes
            # beside the archive, under a name of this start's own.
            crash = path.with_name(_CRASH_REPORT.format(nonce=uuid.uuid4().hex[:12]))
            return (
                f"-XX:SharedArchiveFile={path} -Xlog:cds=off -Xlog:cds+dynamic=off "
                f"-XX:ErrorFile={crash}"
            )
        if not _failed_lately(path):
            _start_build(path)
    except Exception:
        log.debug("no class archive", exc_info=True)
    return ""


def crashed(options: str) -> bool:
    """Whether the JVM started with ``options`` crashed (wrote the crash report they name)."""
    for part in options.split():
        if part.startswith("-XX:ErrorFile="):
            report = Path(part.removeprefix("-XX:ErrorFile="))
            prefix = report.name.split("%p", 1)[0]
            with contextlib.suppress(OSError):
                return any(report.parent.glob(f"{prefix}*"))
    return False


def drop(options: str) -> str:
    """Remove the archive that JVM ``options`` map (a JVM crashed mapping it; no new build for
    FAILED_RETRY_S), and give the options without it."""
    kept = []
    for part in options.split():
        if part.startswith("-XX:SharedArchiveFile="):
            archive = Path(part.removeprefix("-XX:SharedArchiveFile="))
            with contextlib.suppress(OSError):
                archive.unlink()
            _mark_failed(archive)
        elif not part.startswith(("-Xlog:cds", "-XX:ErrorFile=")):
            kept.append(part)
    return " ".join(kept)


def _failed_lately(path: Path) -> bool:
    try:
        return time.time() - path.with_suffix(".failed").stat().st_mtime < FAILED_RETRY_S
    except OSError:
        return False


def _mark_failed(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.with_suffix(".failed").write_text(f"{time.time()}\n")


def _start_build(path: Path) -> None:
    """Start the detached build unless another holds the build's lock (tried here without
    waiting: the builder takes it again and holds it while it runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(path, wait=False) as held:
        if not held:
            return
    with open(path.with_suffix(".log"), "wb") as build_log:
        subprocess.Popen(
            [sys.executable, "-m", "queue_engine.spark.class_archive", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=build_log,
            cwd=tempfile.gettempdir(),
            # Its own session: it belongs to this machine's cache, not to the command that
            # started it, and a Ctrl-C there does not leave the build half done.
            start_new_session=True,
            env=_builder_env(),
        )
    log.info("building Spark's class archive %s in the background", path)


def _builder_env() -> dict[str, str]:
    """This environment for the builder, minus what would tie its Spark to this process's
    (spark-submit's gateway) and with the archive off (it makes it)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYSPARK_GATEWAY_") and k not in ("SPARK_SUBMIT", "PYSPARK_PIN_THREAD")
    }
    env[ENV] = "0"
    return env


@contextlib.contextmanager
def _build_lock(path: Path, *, wait: bool) -> Iterator[bool]:
    """The build's lock (an flock: released when its holder dies, however it dies)."""
    fd = os.open(path.with_suffix(".building"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def build(path: Path) -> bool:
    """Run a small local Spark + delta-spark session whose JVM dumps the classes it loaded to a
    temporary file on exit, then move that file to ``path``. Whether it did (a failure is
    remembered: no new build for FAILED_RETRY_S)."""
    with _build_lock(path, wait=False) as held:
        if not held or path.is_file():
            return path.is_file()
        for stale in path.parent.glob(f"{path.name}.*.partial"):
            with contextlib.suppress(OSError):
                stale.unlink()  # a build killed while its JVM dumped
        done = _build(path)
        if done:
            # Archives of another java or pyspark install (~200 MB each, never used again)
            # and their logs and marks.
            for other in path.parent.glob("spark-classes-*"):
                if not other.name.startswith(path.stem):
                    with contextlib.suppress(OSError):
                        other.unlink()
        else:
            _mark_failed(path)
        return done


def _build(path: Path) -> bool:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    from queue_engine.spark.session import local_java_options

    os.environ["DELTAQ_SPARK_JAVA_OPTIONS"] = (
        f"{local_java_options()} -XX:ArchiveClassesAtExit={partial}"
    )
    from pyspark import SparkContext

    from queue_engine.spark.session import Engine, build_session, engine

    proc = None
    # Spark's own files (spark-warehouse/, derby.log) in a directory of the build's own.
    workdir = tempfile.mkdtemp(prefix="deltaq-class-archive-")
    os.chdir(workdir)
    try:
        spark = build_session(app_name="deltaq-class-archive", quiet=True)
        gateway = SparkContext._gateway
        assert gateway is not None
        proc = gateway.proc
        _exercise(spark, delta=engine(spark) is Engine.DELTA_SPARK)
        spark.stop()
        gateway.shutdown()
        # The JVM exits once its stdin closes, and dumps its classes while it exits.
        proc.stdin.close()
        if proc.wait(BUILD_TIMEOUT_S) != 0 or not partial.is_file():
            return False
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    except Exception:
        log.exception("the class archive could not be built")
        return False
    finally:
        if proc is not None and proc.poll() is None:
            # Killed, its JVM dumps nothing: no partial file is written after the one below
            # is removed.
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            partial.unlink()
        shutil.rmtree(workdir, ignore_errors=True)


def _exercise(spark: SparkSession, *, delta: bool) -> None:
    """What deltaq's jobs do, in small: Delta writes, reads, a MERGE and a stream (Parquet
    where delta-spark's jars could not be had)."""
    with tempfile.TemporaryDirectory(prefix="tables-", dir=os.getcwd()) as tmp:
        fmt = "delta" if delta else "parquet"
        table = os.path.join(tmp, "t")
        rows = spark.range(100).selectExpr("id", "cast(id as string) AS body")
        rows.write.format(fmt).save(table)
        spark.read.format(fmt).load(table).groupBy("body").count().collect()
        if not delta:
            return
        spark.sql(
            f"MERGE INTO delta.`{table}` t USING (SELECT 1L AS id, 'x' AS body) s "
            "ON t.id = s.id WHEN MATCHED THEN UPDATE SET body = s.body"
        )
        query = (
            spark.readStream.format("delta")
            .load(table)
            .writeStream.format("delta")
            .option("checkpointLocation", os.path.join(tmp, "checkpoint"))
            .trigger(availableNow=True)
            .start(os.path.join(tmp, "out"))
        )
        query.awaitTermination()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    # The whole build is bounded: a hung JVM or Ivy lock does not hold the lock for ever.
    signal_alarm = int(BUILD_TIMEOUT_S * 2)
    import signal

    signal.alarm(signal_alarm)
    sys.exit(0 if build(Path(sys.argv[1])) else 1)
