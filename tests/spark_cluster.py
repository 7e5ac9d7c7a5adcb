"""A Spark standalone cluster on 127.0.0.1 for tests: a master and workers started with
pyspark's own ``spark-class`` launcher, on free ports, each worker with its own work directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pyspark

from deltaq.testing.s3 import HOST, free_port

SPARK_HOME = Path(pyspark.__file__).resolve().parent
SPARK_CLASS = SPARK_HOME / "bin" / "spark-class"
SPARK_SUBMIT = SPARK_HOME / "bin" / "spark-submit"


def spark_env() -> dict[str, str]:
    """What every process of the cluster, and every driver, runs with."""
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": HOST,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        # The launcher scripts source conf/spark-env.sh if present; none is wanted.
        "SPARK_CONF_DIR": str(SPARK_HOME / "conf-none"),
        # A daemon whose port was taken meanwhile fails instead of binding the next one (which
        # the tests would not know): the ports come from free_port(), free only when asked.
        "SPARK_DAEMON_JAVA_OPTS": "-Dspark.port.maxRetries=0",
        # Every JVM of the test (master, workers, their executors, drivers) compiles with C1
        # only and collects with the serial collector, as deltaq's local sessions do: they live
        # a few minutes, too short for C2's compilations to pay back their CPU. The cluster
        # test took 119 s of CPU (137 s of wall time) with C1, against 158 s (169 s) with the
        # JVM's default.
        "JAVA_TOOL_OPTIONS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    }


@dataclass
class SparkCluster:
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    ui_port: int = 0
    master: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    def start(self) -> SparkCluster:
        # The executors' scratch files (the jars they fetch, ~86 MB each) with the test's
        # files: a worker the test kills leaves them behind.
        self.env.setdefault("SPARK_LOCAL_DIRS", str(self.workdir / "local"))
        for attempt in range(3):
            self.port, self.ui_port = free_port(), free_port()
            self.master = self._launch(
                "master",
                "org.apache.spark.deploy.master.Master",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
            )
            try:
                self._wait(lambda state: True, "the master", process=self.master)
                break
            except ChildProcessError:
                if attempt == 2:
                    raise
        self.start_worker()
        return self

    def start_worker(self) -> None:
        n = len(self.workers)
        alive = self.alive_workers()
        worker_dir = self.workdir / f"worker-{n}"
        worker_dir.mkdir(parents=True, exist_ok=True)
        self.workers.append(
            self._launch(
                f"worker-{n}",
                "org.apache.spark.deploy.worker.Worker",
                self.url,
                "--host",
                HOST,
                "--cores",
                "2",
                "--memory",
                "2g",
                "--webui-port",
                str(free_port()),
                "--work-dir",
                str(worker_dir),
            )
        )
        self._wait(
            lambda state: state["aliveworkers"] > alive, f"worker {n}", process=self.workers[-1]
        )

    def kill9_worker(self) -> None:
        """kill -9 the newest worker (its executors notice and exit)."""
        worker = self.workers[-1]
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)

    def state(self) -> dict[str, Any]:
        """The master's state from its UI; ``LookupError`` if something else answers there."""
        response = httpx.get(f"http://{HOST}:{self.ui_port}/json/", timeout=5)
        try:
            answer: dict[str, Any] = response.json()
        except ValueError as exc:
            raise LookupError(f"not the master's UI at port {self.ui_port}") from exc
        if answer.get("url") != self.url:
            raise LookupError(f"not this master at port {self.ui_port}: {answer.get('url')}")
        return answer

    def alive_workers(self) -> int:
        try:
            return int(self.state()["aliveworkers"])
        except (httpx.HTTPError, LookupError):
            return 0

    def applications(self) -> list[dict[str, Any]]:
        state = self.state()
        return [*state["activeapps"], *state["completedapps"]]

    def stop(self) -> None:
        for process in [*self.workers, self.master]:
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)

    def _launch(self, name: str, main_class: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        return subprocess.Popen(
            [str(SPARK_CLASS), main_class, *args],
            env={**spark_env(), **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _wait(
        self, ready: Any, what: str, process: subprocess.Popen[bytes], timeout_s: float = 60
    ) -> None:
        """Until ``ready(state)``; ``ChildProcessError`` if ``process`` exits first (e.g. its
        port was taken)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ChildProcessError(f"{what} exited ({process.returncode}); see {self.workdir}")
            try:
                if ready(self.state()):
                    return
            except (httpx.HTTPError, LookupError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{what} did not start; see {self.workdir}")
