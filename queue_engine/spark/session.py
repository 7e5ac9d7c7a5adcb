"""Building the SparkSession: local by default, a cluster master from settings otherwise.

delta-spark, the engine users run on deltaq's tables, is on the session's classpath: its jars
come from Maven Central the way users get them (``configure_spark_with_delta_pip``, i.e.
``spark.jars.packages``, into Ivy's cache), with Delta's SQL extension and catalog, so
``format("delta")``, ``DESCRIBE HISTORY``, ``OPTIMIZE`` and ``VERSION AS OF`` work in deltaq's
own sessions. Where the jars cannot be had (no Maven Central, an empty Ivy cache) the session
starts without them and says so once; deltaq's Python Data Source over delta-rs
(``format("deltaq")``) serves the queue's own reads either way.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from queue_engine.spark import class_archive, scratch
from queue_engine.spark.java import check_java
from queue_engine.store.storage import StoreError, executor_environment

log = logging.getLogger(__name__)

_DELTA_CLASS = "org.apache.spark.sql.delta.sources.DeltaDataSource"
_CHECKPOINT_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)


class Engine(StrEnum):
    DELTA_RS = "delta-rs"  # deltaq's Python Data Source (format "deltaq")
    DELTA_SPARK = "delta-spark"  # format "delta", when its jars load


_CONNECT_PLUGIN = "org.apache.spark.sql.connect.SparkConnectPlugin"
_DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
_DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"


def build_session(
    master: str | None = None,
    app_name: str = "deltaq",
    *,
    connect_port: int | None = None,
    quiet: bool = False,
    delta_spark: bool | None = None,
    packages: Sequence[str] = (),
) -> SparkSession:
    """A SparkSession for deltaq's jobs; ``master`` None means ``local[2]``, small and UI-less.

    ``connect_port`` also serves the session over Spark Connect on 127.0.0.1 (loopback only:
    Spark Connect has no authentication), so ``deltaq sql`` can use it instead of starting a
    JVM. ``quiet`` sends the JVM's own stderr (banners, log4j warnings, Spark Connect's
    errors) to a file, for commands whose output is the answer or that share a terminal.
    ``delta_spark``: put delta-spark on the classpath
    (default: ``DELTAQ_DELTA_SPARK``, true unless "false"); ``packages``: more Maven
    coordinates for ``spark.jars.packages`` (hadoop-aws for ``s3a://``, say).
    """
    if not _inside_spark_submit():
        # Before anything starts a JVM: Spark's own error for a missing or old Java names
        # neither (JavaUnavailableError says what to install).
        check_java()
    if delta_spark is None:
        delta_spark = os.environ.get("DELTAQ_DELTA_SPARK", "true").lower() != "false"
    if delta_spark or packages:
        try:
            return _build_session(
                master, app_name, connect_port, quiet, delta_spark=delta_spark, packages=packages
            )
        except Exception as exc:
            if _gateway_running():
                raise
            # The JVM did not start: most often Ivy could not fetch the jars (no Maven
            # Central, nothing cached). The queue's own reads do not need them.
            log.warning(
                "Spark did not start with %s (%s); starting without them",
                ", ".join(_maven_packages(delta_spark, packages)),
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
    return _build_session(master, app_name, connect_port, quiet, delta_spark=False, packages=())


def _submitted_with(java_class: str) -> bool:
    """Whether ``java_class`` loads in the JVM spark-submit started (its gateway is up before
    any session is)."""
    from pyspark import SparkContext

    try:
        SparkContext._ensure_initialized()
        jvm = SparkContext._jvm
        return bool(jvm.org.apache.spark.util.Utils.classIsLoadable(java_class))  # type: ignore[union-attr]
    except Exception:
        log.debug("could not ask spark-submit's JVM for %s", java_class, exc_info=True)
        return False


def _gateway_running() -> bool:
    from pyspark import SparkContext

    return SparkContext._gateway is not None


def _maven_packages(delta_spark: bool, packages: Sequence[str]) -> list[str]:
    """The Maven coordinates a session asks for: delta-spark's jar for this pyspark's line
    (as ``configure_spark_with_delta_pip`` names it) and ``packages``."""
    return [delta_spark_package(), *packages] if delta_spark else list(packages)


def delta_spark_package() -> str:
    """The Maven coordinate of the installed delta-spark's jar for the installed pyspark's
    line, as ``delta.configure_spark_with_delta_pip`` asks for it (Delta 4.x publishes one
    artifact per Spark line, e.g. ``io.delta:delta-spark_4.2_2.13:4.4.0``)."""
    from importlib.metadata import version

    import pyspark

    spark_line = ".".join(pyspark.__version__.split(".")[:2])
    return f"io.delta:delta-spark_{spark_line}_2.13:{version('delta-spark')}"


def hadoop_aws_package() -> str:
    """The Maven coordinate of hadoop-aws (Hadoop's S3A) for the Hadoop that this pyspark
    ships: the two must be the same version."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    [api] = sorted(jars.glob("hadoop-client-api-*.jar"))
    return f"org.apache.hadoop:hadoop-aws:{api.name.removeprefix('hadoop-client-api-')[:-4]}"


def _build_session(
    master: str | None,
    app_name: str,
    connect_port: int | None,
    quiet: bool,
    *,
    delta_spark: bool,
    packages: Sequence[str],
) -> SparkSession:
    if delta_spark and _inside_spark_submit() and not _submitted_with(_DELTA_CLASS):
        # spark-submit fixed the classpath before this driver ran: without delta-spark's jars
        # there, its extension and catalog would break the session.
        log.warning(
            "delta-spark is not on this spark-submit's classpath (pass --packages %s); "
            "going on without it",
            delta_spark_package(),
        )
        delta_spark = False
    # Spark's Python workers must run this interpreter (the venv's), not whatever is on PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = master is None or master.startswith("local")
    if local:
        # A local Spark talks to itself only: keep its driver and block manager on loopback.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app_name)
    java_options = ""
    if master or not _inside_spark_submit():
        builder = (
            builder.master(master or "local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.driver.memory", os.environ.get("DELTAQ_SPARK_DRIVER_MEMORY", "1g"))
            .config("spark.sql.session.timeZone", "UTC")
            # Streaming checkpoints through Hadoop's FileSystem API: the default FileContext
            # manager took ~100 ms per offset/commit log entry on local disk here (~15 ms this
            # way), twice per micro-batch, which was a third of the fanout's latency.
            .config("spark.sql.streaming.checkpointFileManagerClass", _CHECKPOINT_MANAGER)
        )
        if local:
            builder = builder.config("spark.driver.host", "127.0.0.1").config(
                "spark.driver.bindAddress", "127.0.0.1"
            )
            # A JVM spark-submit started was running before this code.
            archive = "" if _inside_spark_submit() else class_archive.java_options()
            # Its copies of the jars (~86 MB) and the JVM's other temporary files where the
            # next driver finds and removes them if this one is killed (scratch.py).
            scratch_dir = scratch.local_dir()
            tmpdir = ""
            if scratch_dir is not None:
                builder = builder.config("spark.local.dir", scratch_dir)
                if not any(c.isspace() or c in "'\"\\" for c in scratch_dir):
                    tmpdir = f"-Djava.io.tmpdir={scratch_dir}"
            java_options = " ".join(filter(None, (local_java_options(), archive, tmpdir)))
            builder = builder.config("spark.driver.extraJavaOptions", java_options)
    for name, value in executor_environment().items():
        builder = builder.config(f"spark.executorEnv.{name}", value)
    for key, value in s3a_options(os.environ).items():
        builder = builder.config(f"spark.hadoop.{key}", value)
    if delta_spark:
        builder = builder.config("spark.sql.extensions", _DELTA_EXTENSION).config(
            "spark.sql.catalog.spark_catalog", _DELTA_CATALOG
        )
        if local:
            # Delta rebuilds a table's snapshot in 50 tasks by default: on two local cores a
            # count of an empty table took ~4 s, an ALTER TABLE ~5 s (~0.6 s with 2).
            builder = builder.config("spark.databricks.delta.snapshotPartitions", "2")
            # VACUUM lists a table's files in this many tasks (10,000 by default): a VACUUM of a
            # three-file table took 73 s on two local cores, 4.7 s with 2.
            builder = builder.config(
                "spark.sql.sources.parallelPartitionDiscovery.parallelism", "2"
            )
    wanted = _maven_packages(delta_spark, packages)
    with _resolving(wanted) as jars:
        spark = _start(builder, wanted, jars, connect_port, quiet=quiet, java_options=java_options)
    register(spark)
    log.info(
        "Spark %s (%s); Delta engine: %s", spark.version, spark.sparkContext.master, engine(spark)
    )
    return spark


def _start(
    builder: SparkSession.Builder,
    wanted: Sequence[str],
    jars: list[str] | None,
    connect_port: int | None,
    *,
    quiet: bool,
    java_options: str,
) -> SparkSession:
    """Start the session; ``java_options``: the driver JVM's, as ``builder`` has them."""
    if wanted and not _inside_spark_submit():
        # spark-submit resolves its --packages itself, before this driver runs.
        if jars is not None:
            builder = builder.config("spark.jars", ",".join(jars))
        else:
            builder = builder.config("spark.jars.packages", ",".join(wanted))
    if connect_port:
        builder = (
            builder.config("spark.plugins", _CONNECT_PLUGIN)
            .config("spark.connect.grpc.binding.address", "127.0.0.1")
            .config("spark.connect.grpc.binding.port", str(connect_port))
        )
    try:
        spark = _with_jvm_stderr_to_file(builder) if quiet else builder.getOrCreate()
    except Exception:
        if _gateway_running() or not class_archive.crashed(java_options):
            raise
        # A JVM that cannot map its class archive (damaged on disk) crashes as it starts:
        # without the archive it starts (and no new one is built for a while).
        log.warning("Spark did not start with its class archive; starting without it")
        kept = class_archive.drop(java_options)
        builder = builder.config("spark.driver.extraJavaOptions", kept)
        spark = _with_jvm_stderr_to_file(builder) if quiet else builder.getOrCreate()
    if wanted and jars is None and not _inside_spark_submit():
        _remember_jars(wanted, spark.sparkContext.getConf().get("spark.jars", ""))
    return spark


def s3a_options(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """Hadoop S3A's options for the S3 endpoint the store's variables name, so that Spark
    (an ``s3a://`` checkpoint, delta-spark's reads) reaches the same store as delta-rs. S3A
    takes the credentials from the same variables itself; AWS's own endpoint needs nothing."""
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return {}
    options = {
        "fs.s3a.endpoint": endpoint,
        # A custom endpoint (MinIO, moto, Ceph) rarely serves virtual-hosted buckets.
        "fs.s3a.path.style.access": "true",
    }
    if endpoint.startswith("http://") or env.get("AWS_ALLOW_HTTP", "").lower() == "true":
        options["fs.s3a.connection.ssl.enabled"] = "false"
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        options["fs.s3a.endpoint.region"] = region
    return options


def _jars_list(wanted: Sequence[str]) -> Path:
    """Where the jar files Ivy resolved for ``wanted`` are listed: resolving again costs ~2 s
    of every session's start even with every jar in Ivy's cache."""
    key = hashlib.sha256(",".join(wanted).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "deltaq" / f"spark-jars-{key}.txt"


@contextlib.contextmanager
def _resolving(wanted: Sequence[str]) -> Iterator[list[str] | None]:
    """The jars resolved for ``wanted`` before (None: Ivy resolves them now). While Ivy
    resolves, other processes of this machine wait for it: two Ivy resolutions into one cache
    at once can leave each other's files half-written (several sessions start together under
    a parallel test run, or two ``deltaq up``)."""
    jars = _cached_jars(wanted)
    if jars is not None or not wanted or _inside_spark_submit():
        yield jars
        return
    lock = _jars_list(wanted).with_suffix(".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Another process may have resolved them while this one waited.
        yield _cached_jars(wanted)
    finally:
        os.close(fd)


def _cached_jars(wanted: Sequence[str]) -> list[str] | None:
    """The jar files resolved for ``wanted`` before, if every one of them is still there."""
    if not wanted:
        return None
    try:
        jars = _jars_list(wanted).read_text().split()
    except OSError:
        return None
    if not jars or not all(os.path.isfile(j.removeprefix("file:")) for j in jars):
        return None
    return jars


def _remember_jars(wanted: Sequence[str], spark_jars: str) -> None:
    jars = [j for j in spark_jars.split(",") if j]
    if not jars:
        return
    path = _jars_list(wanted)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text("\n".join(jars) + "\n")
        staging.replace(path)
    except OSError:
        log.debug("could not remember the resolved jars in %s", path, exc_info=True)


# The JVM's optimising compiler (C2) off in local mode: on two cores its compiler threads
# competed with the micro-batches for the first ~10 s of a stream and recompiled now and then
# afterwards; with the quick compiler (C1) alone the fanout's publish -> channel latency went
# from p50 ~240 / p99 ~800 ms to p50 ~110 / p99 ~250 ms, and a 1.1M-message backlog moved
# faster too (18.3 s vs 25.3 s wall). The serial collector: a 1 GB driver heap on a few cores
# gains nothing from G1's concurrent threads, and without them the same Delta reads and Spark
# SQL queries took ~12% less CPU (93-101 against 108-112 CPU-s in runs in turn), with the same
# start and no worse publish -> delivered under deltaq up. A cluster master keeps the JVM's
# defaults.
LOCAL_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def local_java_options() -> str:
    """The local driver JVM's options: ``DELTAQ_SPARK_JAVA_OPTIONS`` or LOCAL_JAVA_OPTIONS."""
    return os.environ.get("DELTAQ_SPARK_JAVA_OPTIONS", LOCAL_JAVA_OPTIONS)


# Local drivers' JVM logs kept in $TMPDIR/deltaq-spark (for a look after a crash): a driver
# that starts removes all but the newest, so a jobs process restarted over and over does not
# fill the directory.
JVM_LOGS_KEPT = 50


def jvm_log_path(log_dir: str | None = None) -> str:
    """This process's JVM log, in ``log_dir`` (default ``$TMPDIR/deltaq-spark``), after
    removing the logs there beyond the newest JVM_LOGS_KEPT, but for running processes'."""
    import tempfile

    import psutil

    log_dir = log_dir or os.path.join(tempfile.gettempdir(), "deltaq-spark")
    os.makedirs(log_dir, exist_ok=True)
    logs: list[tuple[float, str, str]] = []
    for entry in os.scandir(log_dir):
        if entry.name.startswith("jvm-") and entry.name.endswith(".log"):
            with contextlib.suppress(FileNotFoundError):
                logs.append((entry.stat().st_mtime, entry.path, entry.name[4:-4]))
    logs.sort(reverse=True)
    for _, path, pid in logs[JVM_LOGS_KEPT:]:
        if pid.isdigit() and psutil.pid_exists(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return os.path.join(log_dir, f"jvm-{os.getpid()}.log")


def _with_jvm_stderr_to_file(builder: SparkSession.Builder) -> SparkSession:
    """Start the JVM with its stderr going to a log file: the JVM inherits file descriptor 2
    when PySpark launches it, so point that at the file while it starts."""
    path = jvm_log_path()
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log_file:
        os.dup2(log_file.fileno(), 2)
        try:
            spark = builder.getOrCreate()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    log.info("Spark's own log (its JVM's output): %s", path)
    return spark


def quiet_stream_stop(spark: SparkSession) -> None:
    """Stopping a streaming query between micro-batches makes Spark's DAGScheduler warn that it
    found no active job to cancel: expected on every clean stop, so not worth a warning."""
    try:
        jvm = spark.sparkContext._jvm
        level = jvm.org.apache.logging.log4j.Level.ERROR  # type: ignore[union-attr]
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(  # type: ignore[union-attr]
            "org.apache.spark.scheduler.DAGScheduler", level
        )
    except Exception:
        log.debug("could not lower the DAGScheduler's log level", exc_info=True)


def checkpoint_location(spark: SparkSession, path: str) -> str:
    """``path`` as Spark's streaming checkpoint can use it. Spark writes checkpoints through
    Hadoop's FileSystem: an ``s3://`` warehouse is reached as ``s3a://`` where only hadoop-aws's
    S3A is present (vanilla Hadoop), and a scheme Spark has no FileSystem for is refused with
    what to do, before the stream starts."""
    location = hadoop_path(spark, path)
    if location is not None:
        return location
    scheme = path.split("://", 1)[0]
    raise CheckpointLocationError(
        f"Spark has no Hadoop FileSystem for {scheme}:// to keep the streaming checkpoint "
        f"{path}: put the store's connector on Spark's classpath (for S3: hadoop-aws, as "
        "spark.jars.packages=org.apache.hadoop:hadoop-aws:<Spark's Hadoop version>), or give "
        "--checkpoint a location Spark can write (HDFS, or a local path on a one-driver "
        "deployment)"
    )


def hadoop_path(spark: SparkSession, path: str) -> str | None:
    """``path`` as Spark's Hadoop FileSystem reaches it (``s3://`` as ``s3a://`` where only
    S3A exists), or None where Spark has no FileSystem for its scheme."""
    scheme = path.split("://", 1)[0] if "://" in path else "file"
    candidates = [scheme, "s3a"] if scheme == "s3" else [scheme]
    for candidate in candidates:
        if _has_filesystem(spark, candidate):
            return path if candidate == scheme else f"{candidate}://{path.split('://', 1)[1]}"
    return None


class CheckpointLocationError(StoreError):
    """The streaming checkpoint cannot live where it was asked to."""


def checkpoint_has_batches(spark: SparkSession, location: str) -> bool:
    """Whether Spark's streaming checkpoint at ``location`` has recorded any micro-batch."""
    try:
        jvm, conf = _hadoop(spark)
        path = jvm.org.apache.hadoop.fs.Path(f"{location.rstrip('/')}/offsets")
        fs = path.getFileSystem(conf)
        return bool(fs.exists(path)) and len(fs.listStatus(path)) > 0
    except Exception:
        # A Spark Connect session has no JVM here: Spark itself validates the checkpoint.
        return True


def _has_filesystem(spark: SparkSession, scheme: str) -> bool:
    try:
        jvm, conf = _hadoop(spark)
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, conf)
    except Exception:
        return False
    return True


def _hadoop(spark: SparkSession) -> tuple[Any, Any]:
    """The driver's JVM and Hadoop configuration (raises on a Spark Connect client)."""
    return spark.sparkContext._jvm, spark.sparkContext._jsc.hadoopConfiguration()


def remote_session(url: str) -> SparkSession:
    """A Spark Connect client session (e.g. on the Spark that deltaq up runs)."""
    spark = SparkSession.builder.remote(url).getOrCreate()
    # Reattachable execution releases each result asynchronously: a short query's session
    # was closed before those calls arrived, and the server logged a stack trace for each.
    spark.client.disable_reattachable_execute()
    register(spark)
    return spark


class LazySession:
    """A SparkSession built the first time it is asked for: a one-shot job that may not need
    Spark (a sweep small enough to fold on the driver) does not start a JVM for nothing."""

    def __init__(self, build: Callable[[], SparkSession]) -> None:
        self._build = build
        self._session: SparkSession | None = None

    def get(self) -> SparkSession:
        if self._session is None:
            self._session = self._build()
        return self._session

    @property
    def built(self) -> bool:
        return self._session is not None

    def stop(self) -> None:
        if self._session is not None:
            self._session.stop()


def runs_locally(master: str | None) -> bool:
    """Whether a session for ``master`` would be a local Spark this process starts (not a
    cluster's, nor the one spark-submit started)."""
    return (master is None or master.startswith("local")) and not _inside_spark_submit()


def _inside_spark_submit() -> bool:
    """Whether spark-submit started this driver: it runs the Python driver from its JVM and
    hands it the gateway's port; its --master (or spark-defaults) must then stand."""
    return "PYSPARK_GATEWAY_PORT" in os.environ or "SPARK_SUBMIT" in os.environ


def engine(spark: SparkSession) -> Engine:
    """delta-spark when its data source class loads in this JVM, else deltaq's own source."""
    try:
        # A Spark Connect client has no JVM here (sparkContext raises): deltaq's own source.
        jvm = spark.sparkContext._jvm
        loadable = bool(jvm.org.apache.spark.util.Utils.classIsLoadable(_DELTA_CLASS))  # type: ignore[union-attr]
    except Exception:
        loadable = False
    return Engine.DELTA_SPARK if loadable else Engine.DELTA_RS


def read_format(spark: SparkSession) -> str:
    """The format batch reads of deltaq's tables use: "delta" where delta-spark loads, else
    "deltaq". Both take ``versionAsOf``; deltaq's own options (``afterVersion``/``toVersion``,
    the topics stream) keep their readers on "deltaq"."""
    return "delta" if engine(spark) is Engine.DELTA_SPARK else "deltaq"


def register(spark: SparkSession) -> None:
    """Make ``format("deltaq")`` available on ``spark``."""
    from queue_engine.spark.source import DeltaqDataSource

    spark.dataSource.register(DeltaqDataSource)
