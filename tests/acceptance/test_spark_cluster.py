"""The jobs on a real Spark cluster: a standalone master and worker on 127.0.0.1 (pyspark's own
``spark-class``), the warehouse on moto's S3 server, the jobs run as users run them
(``deltaq fanout --master spark://...`` and ``spark-submit jobs/sweep.py``), the topic rows read
by tasks on the executors. Exactly once across kill -9 of the driver and of the worker."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deltalake import DeltaTable

from deltaq.testing.s3 import S3Server, storage_options, store_env
from queue_engine.spark.session import delta_spark_package
from queue_engine.store.tables import Warehouse
from tests.acceptance.conftest import BUCKET
from tests.conftest import ROOT, Server
from tests.consumers import create_channel
from tests.spark_cluster import SPARK_CLASS, SPARK_SUBMIT, SparkCluster, spark_env

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path, s3_server: S3Server) -> Iterator[SparkCluster]:
    if not SPARK_CLASS.exists():
        pytest.skip(f"pyspark has no launcher at {SPARK_CLASS}")
    # Executors reach the store through the worker's environment, as on a real cluster.
    c = SparkCluster(tmp_path / "spark", env=store_env(s3_server.endpoint))
    c.workdir.mkdir()
    try:
        yield c.start()
    finally:
        c.stop()


def driver(
    args: list[str], env: dict[str, str], log: Path, *, submit: bool = False
) -> subprocess.Popen[bytes]:
    command = [str(SPARK_SUBMIT), *args] if submit else [sys.executable, "-m", "deltaq", *args]
    return subprocess.Popen(
        command,
        env={**spark_env(), **env},
        cwd=ROOT,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )


def channel_bodies(root: str, env: dict[str, str], topic: str, channel: str) -> list[bytes]:
    path = Warehouse(root).channel_messages_path(topic, channel)
    rows: list[bytes] = (
        DeltaTable(path, storage_options=storage_options(env))
        .to_pyarrow_table()["body"]
        .to_pylist()
    )
    return rows


@pytest.mark.timeout(900)  # two kills, three Spark drivers on a busy 2-core machine
def test_fanout_and_sweep_run_on_the_cluster_exactly_once_across_kill_9_of_worker_and_driver(
    cluster: SparkCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    # A short lease: the second driver waits for the killed one's fanout lock to lapse.
    env = {**store_env(s3_server.endpoint), "DELTAQ_STORE_LEASE_S": "3"}
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    server = Server(tmp_path / "wh", env=env, warehouse_url=root).start()
    sent: list[bytes] = []
    stop = threading.Event()

    def publish() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            i = 0
            while not stop.is_set() and i < 2_000:
                payload = f"e{i}".encode()
                if c.post("/pub", params={"topic": "events"}, content=payload).text == "OK":
                    sent.append(payload)
                i += 1
                time.sleep(0.005)

    with httpx.Client(base_url=server.url, timeout=30) as c:
        create_channel(c, "events", "sink")
    producer = threading.Thread(target=publish)
    producer.start()
    # The checkpoint is the default, in the store (mirrored from the driver's local copy): the
    # second driver starts with none of the first one's local files.
    args = ["fanout", "--master", cluster.url, "--warehouse", root]
    try:
        fanout = driver(args, env, tmp_path / "fanout-1.log")
        _wait_for_rows(root, env, 1, fanout, tmp_path / "fanout-1.log")
        cluster.kill9_worker()  # executors gone mid-stream
        cluster.start_worker()
        seen = len(channel_bodies(root, env, "events", "sink"))
        _wait_for_rows(root, env, seen + 1, fanout, tmp_path / "fanout-1.log")
        fanout.send_signal(signal.SIGKILL)  # the driver, mid-stream
        fanout.wait(10)
    finally:
        stop.set()
        producer.join(60)
        server.stop()
    # A new driver from the checkpoint in the store finishes the work: each message exactly once.
    log = tmp_path / "fanout-2.log"
    rest = driver([*args, "--once"], env, log)
    assert rest.wait(240) == 0, log.read_text()[-3000:]
    stored = channel_bodies(root, env, "events", "sink")
    assert len(stored) == len(set(stored))
    assert sorted(stored) == sorted(sent)
    assert len(sent) > 100
    # The executors read the topic rows and wrote the channel rows: the driver only commits.
    assert "topic rows read by tasks on the executors" in log.read_text()
    assert "channel tables written with format(deltaq)" in log.read_text()

    # docs/deploy.md's cron line, as written but for the cluster's master and the warehouse:
    # spark-submit of the sweep with delta-spark's jars from --packages (Ivy's cache).
    sweep_log = tmp_path / "sweep.log"
    sweep_args = cron_sweep_args((ROOT / "docs" / "deploy.md").read_text(), cluster.url, root)
    assert delta_spark_package() in sweep_args  # the coordinate deltaq installs, not a stale one
    sweep = driver(sweep_args, env, sweep_log, submit=True)
    assert sweep.wait(240) == 0, sweep_log.read_text()[-3000:]
    assert "swept 1 channels" in sweep_log.read_text()
    assert "Delta engine: delta-spark" in sweep_log.read_text()
    # Each ran as an application of the cluster, with executors on its workers.
    names = {app["name"] for app in cluster.applications()}
    assert {"deltaq-fanout", "deltaq-sweep"} <= names, names
    executor_logs = list(cluster.workdir.glob("worker-*/app-*/*/stderr"))
    assert len(executor_logs) >= 3, executor_logs


def cron_sweep_args(doc: str, master: str, warehouse: str) -> list[str]:
    """spark-submit's arguments in the crontab line of ``doc``, with its example master and
    warehouse replaced."""
    [line] = [ln for ln in doc.splitlines() if ln.startswith("*/1 * * * * spark-submit ")]
    command = line.split(maxsplit=5)[5]
    command = command.replace("spark://master:7077", master)
    command = command.replace("s3://my-bucket/deltaq", warehouse)
    args = shlex.split(command)
    assert args[0] == "spark-submit" and "jobs/sweep.py" in args, line
    return args[1:]


def _wait_for_rows(
    root: str, env: dict[str, str], n: int, fanout: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert fanout.poll() is None, log.read_text()[-3000:]
        try:
            if len(channel_bodies(root, env, "events", "sink")) >= n:
                return
        except Exception:  # the channel table is created by the first batch
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the fanout wrote fewer than {n} rows: {log.read_text()[-3000:]}")
