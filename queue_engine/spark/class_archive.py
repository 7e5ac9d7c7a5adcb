"""A class-data archive of the Spark driver's JVM (the JDK's application class-data sharing,
CDS): the classes a Spark + delta-spark session loads, parsed and verified once and mapped from
a file by every later JVM.

A Spark driver's JVM spends most of its first seconds loading and verifying ~20,000 classes:
on two cores a local session with delta-spark took ~9.5 s of CPU to start and ~14 s to run its
first Delta query. Mapped from an archive, the same took ~5.8 s and ~8 s of CPU, ~3 s less
wall time to start (``deltaq up``, ``deltaq sql``, every job).

The archive is made once a machine (per java and pyspark install) by a detached process that
runs a small session under ``-XX:ArchiveClassesAtExit``, in the background of the first session
that finds none: dumping costs its JVM ~20 s more than an ordinary run, which no command a user
waits on should pay. The archive is written to a temporary name, fsync'd and renamed into place
only once its JVM has exited cleanly: a torn archive crashes the JVM that maps it, so no session
may ever see a partial one (a power cut included). A session that still cannot start with it
removes it and starts without (``session._start``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from queue_engine.spark.java import java_executable

log = logging.getLogger(__name__)

# Unset or "1": use the archive, making it when absent; "0": neither.
ENV = "DELTAQ_SPARK_CLASS_ARCHIVE"
# A claim older than this is taken over: a build that was killed (a build takes ~1 min).
STALE_CLAIM_S = 600.0
# How long a build's JVM may take to exit and dump its classes.
DUMP_TIMEOUT_S = 300.0


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def archive_path() -> Path | None:
    """Where the archive of this java and pyspark install is (whether it exists or not);
    None where there is no java to key it by."""
    java, _ = java_executable()
    if java is None:
        return None
    import pyspark

    real = os.path.realpath(java)
    jars = Path(pyspark.__file__).parent / "jars"
    key = hashlib.sha256()
    try:
        st = os.stat(real)
        key.update(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{jars}\0".encode())
        for jar in sorted(jars.iterdir()):
            key.update(f"{jar.name}\0{jar.stat().st_size}\0".encode())
    except OSError:
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "deltaq" / f"spark-classes-{key.hexdigest()[:16]}.jsa"


def java_options() -> str:
    """The driver JVM's options that map the archive, or "" (and, where there is none yet, a
    detached build of it is started unless one is under way)."""
    if not enabled():
        return ""
    path = archive_path()
    if path is None:
        return ""
    if path.is_file():
        # The JVM logs nothing about the archive: an archive it cannot use (another JVM
        # build behind the same path) only costs the time it saves.
        # A JVM that cannot map a damaged archive crashes before Spark starts: its crash
        # report goes beside the archive, not into the user's working directory.
        crash = path.with_name("hs_err_pid%p.log")
        return (
            f"-XX:SharedArchiveFile={path} -Xlog:cds=off -Xlog:cds+dynamic=off "
            f"-XX:ErrorFile={crash}"
        )
    _start_build(path)
    return ""


def crashed_since(options: str, started: float) -> bool:
    """Whether a JVM given ``options`` crashed (wrote its crash report) since ``started``."""
    for part in options.split():
        if part.startswith("-XX:SharedArchiveFile="):
            archive = Path(part.removeprefix("-XX:SharedArchiveFile="))
            with contextlib.suppress(OSError):
                return any(
                    report.stat().st_mtime >= started
                    for report in archive.parent.glob("hs_err_pid*.log")
                )
    return False


def drop(options: str) -> str:
    """Remove the archive that JVM ``options`` map (a JVM could not start with it), and give
    the options without it."""
    kept = []
    for part in options.split():
        if part.startswith("-XX:SharedArchiveFile="):
            with contextlib.suppress(OSError):
                os.unlink(part.removeprefix("-XX:SharedArchiveFile="))
        elif not part.startswith(("-Xlog:cds", "-XX:ErrorFile=")):
            kept.append(part)
    return " ".join(kept)


def _claim(path: Path) -> bool:
    """Whether this process may start the build of ``path`` (no other claim is live)."""
    claim = path.with_suffix(".building")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            age = time.time() - claim.stat().st_mtime
        except OSError:
            return False
        if age < STALE_CLAIM_S:
            return False
        with contextlib.suppress(OSError):
            claim.unlink()
        return _claim(path)
    except OSError:
        return False
    os.close(fd)
    return True


def _start_build(path: Path) -> None:
    if not _claim(path):
        return
    try:
        with open(path.with_suffix(".log"), "wb") as build_log:
            subprocess.Popen(
                [sys.executable, "-m", "queue_engine.spark.class_archive", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=build_log,
                # Its own session: it belongs to this machine's cache, not to the command
                # that started it, and a Ctrl-C there does not leave the build half done.
                start_new_session=True,
                env={**os.environ, ENV: "0"},
            )
        log.info("building Spark's class archive %s in the background", path)
    except OSError:
        log.debug("could not start the class archive's build", exc_info=True)
        with contextlib.suppress(OSError):
            path.with_suffix(".building").unlink()


def build(path: Path) -> bool:
    """Run a small Spark + delta-spark session whose JVM dumps the classes it loaded to a
    temporary file on exit, then move that file to ``path``. Whether it did."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    os.environ["DELTAQ_SPARK_JAVA_OPTIONS"] = (
        f"{os.environ.get('DELTAQ_SPARK_JAVA_OPTIONS', '')} -XX:ArchiveClassesAtExit={partial}"
    ).strip()
    from pyspark import SparkContext

    from queue_engine.spark.session import build_session

    try:
        spark = build_session(app_name="deltaq-class-archive", quiet=True)
        _exercise(spark)
        gateway = SparkContext._gateway
        assert gateway is not None
        proc = gateway.proc
        spark.stop()
        gateway.shutdown()
        # The JVM exits once its stdin closes, and dumps its classes while it exits.
        proc.stdin.close()
        if proc.wait(DUMP_TIMEOUT_S) != 0 or not partial.is_file():
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
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()
        with contextlib.suppress(OSError):
            path.with_suffix(".building").unlink()


def _exercise(spark: object) -> None:
    """What deltaq's jobs do, in small: Delta writes, reads, a MERGE and a stream."""
    from pyspark.sql import SparkSession

    assert isinstance(spark, SparkSession)
    with tempfile.TemporaryDirectory(prefix="deltaq-class-archive-") as tmp:
        table = os.path.join(tmp, "t")
        spark.range(100).selectExpr("id", "cast(id as string) AS body").write.format("delta").save(
            table
        )
        spark.read.format("delta").load(table).groupBy("body").count().collect()
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
    sys.exit(0 if build(Path(sys.argv[1])) else 1)
