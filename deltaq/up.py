"""deltaq up: the API in this process, the jobs (fanout, sweep, Spark Connect) in a child."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from jobs.command import JAVA_UNAVAILABLE, SETTINGS_FROM_STDIN, settings_json
from queue_engine.settings import Settings
from queue_engine.spark.java import JavaUnavailableError, check_java

log = logging.getLogger("deltaq.up")


# Back-off between restarts of a jobs process that died: doubling from the first to the last,
# and back to the first once a process has run for RESTART_RESET_S.
RESTART_BACKOFF_S = (1.0, 60.0)
RESTART_RESET_S = 60.0


class JobsSupervisor:
    """The jobs child (fanout, sweep, Spark Connect): started, restarted with back-off when it
    dies (logged), stopped in order; ``status`` is what /info, /stats and /metrics show."""

    def __init__(
        self, settings: Settings, api_started: threading.Event, *, verbose: bool = False
    ) -> None:
        self.settings = settings
        self.verbose = verbose
        self._api_started = api_started
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._state = "starting"
        self._restarts = 0
        self._last_exit: int | None = None
        self._since = time.time()
        self._announced = False
        self._alive: int | None = None
        # Why the jobs cannot run (no usable Java): they are not started again.
        self._error: str | None = None

    def status(self) -> dict[str, object]:
        with self._lock:
            return {
                "state": self._state,
                "pid": self._child.pid if self._child is not None else None,
                "restarts": self._restarts,
                "last_exit_code": self._last_exit,
                "since": int(self._since),
                **({"error": self._error} if self._error else {}),
            }

    def start(self) -> int | None:
        """Start the jobs process and its watch; None when they cannot run here (no usable
        Java: one line says what to install, the API serves on without them)."""
        try:
            check_java()
        except JavaUnavailableError as exc:
            self._fail(str(exc))
            threading.Thread(target=self._announce_without_jobs, daemon=True).start()
            return None
        pid = self._spawn()
        threading.Thread(target=self._watch, daemon=True, name="deltaq-jobs-watch").start()
        return pid

    def _spawn(self) -> int:
        ready_read, ready_write = os.pipe()
        # The child watches this pipe's read end from its first line; this process holds the
        # write end (not inherited by anything else) until it ends, however it ends.
        alive_read, alive_write = os.pipe()
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltaq",
                "jobs",
                "--config",
                SETTINGS_FROM_STDIN,
                "--ready-fd",
                str(ready_write),
                "--parent-fd",
                str(alive_read),
                *(["--verbose"] if self.verbose else []),
            ],
            stdin=subprocess.PIPE,
            pass_fds=(ready_write, alive_read),
            # Its own session: a Ctrl-C in the terminal reaches this process only, which then
            # stops the child in order (a JVM interrupted mid-batch logs cancelled jobs).
            start_new_session=True,
        )
        os.close(ready_write)
        os.close(alive_read)
        if self._alive is not None:
            os.close(self._alive)  # the previous child's, which is gone
        self._alive = alive_write
        assert child.stdin is not None
        child.stdin.write(settings_json(self.settings).encode())
        child.stdin.close()
        with self._lock:
            self._child = child
            self._state = "starting"
            self._since = time.time()
        threading.Thread(
            target=self._wait_ready, args=(ready_read, child), daemon=True, name="deltaq-ready"
        ).start()
        return child.pid

    def _fail(self, why: str) -> None:
        with self._lock:
            self._state = "failed"
            self._error = why
            self._since = time.time()
        log.error("the jobs (fanout, sweep, Spark Connect) cannot start: %s", why)

    def _announce_without_jobs(self) -> None:
        self._api_started.wait()
        _announce_ready(self.settings, jobs=False)

    def _wait_ready(self, ready_fd: int, child: subprocess.Popen[bytes]) -> None:
        with os.fdopen(ready_fd, "rb") as ready:
            jobs_ready = ready.readline().strip() == b"ready"
        if not jobs_ready:
            log.error("the jobs process (pid %d) stopped before it was ready", child.pid)
            return
        with self._lock:
            if self._child is child:
                self._state = "running"
        if self._announced:
            log.info("jobs process running again (pid %d)", child.pid)
            return
        self._announced = True
        self._api_started.wait()
        _announce_ready(self.settings)

    def _watch(self) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while True:
            with self._lock:
                child = self._child
            assert child is not None
            code = child.wait()
            if code == JAVA_UNAVAILABLE and not self._stop.is_set():
                # Java went away or changed under a running deltaq up: restarting cannot help.
                try:
                    check_java()
                except JavaUnavailableError as exc:
                    with self._lock:
                        self._last_exit = code
                    self._fail(str(exc))
                    return
            with self._lock:
                if self._stop.is_set():
                    self._state = "stopped"
                    return
                self._last_exit = code
                self._state = "restarting"
                ran_for = time.time() - self._since
            if ran_for >= RESTART_RESET_S:
                backoff = RESTART_BACKOFF_S[0]
            log.error(
                "the jobs process (pid %d: fanout, sweep) exited with code %d; restarting in "
                "%.0f s",
                child.pid,
                code,
                backoff,
            )
            if self._stop.wait(backoff):
                with self._lock:
                    self._state = "stopped"
                return
            with self._lock:
                self._restarts += 1
            pid = self._spawn()
            log.info("jobs process restarted: pid %d", pid)
            if self._stop.is_set():  # stop() came while it started: it stops this one too
                self.stop()
                return
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            child = self._child
        if child is None:
            return
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(120)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def up(settings: Settings, *, verbose: bool = False) -> int:
    """Serve until Ctrl-C (or SIGTERM), then stop the child: the API answers waiting SUBs and
    commits what is pending, the child stops its stream and its sweep loop. A child that dies
    meanwhile is started again."""
    from api.server import serve
    from queue_engine.ports import spark_connect_listener

    if "://" not in settings.warehouse:
        # The child resolves paths from the same place, whatever its working directory.
        settings = settings.model_copy(update={"warehouse": os.path.abspath(settings.warehouse)})
    api_started = threading.Event()
    jobs = JobsSupervisor(settings, api_started, verbose=verbose)
    try:
        # The warehouse is the API's before any job opens it (a second deltaq up stops here).
        serve(
            settings,
            on_started=api_started.set,
            jobs_status=jobs.status,
            also_listening=spark_connect_listener(settings),
            # uvicorn's own start-up lines only when asked: deltaq's say the same.
            server_log_level="info" if verbose else "warning",
            before_serving=lambda: _starting(jobs, settings),
        )
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after its graceful shutdown
    finally:
        if jobs.status()["pid"] is not None:  # not when refused before starting anything
            jobs.stop()
            log.info("stopped")
    return 0


def _starting(jobs: JobsSupervisor, settings: Settings) -> None:
    pid = jobs.start()
    if pid is None:
        log.info("starting: API in pid %d, warehouse %s", os.getpid(), settings.warehouse)
    else:
        log.info(
            "starting: API in pid %d, fanout + sweep on local Spark in pid %d, warehouse %s",
            os.getpid(),
            pid,
            settings.warehouse,
        )


def _announce_ready(settings: Settings, *, jobs: bool = True) -> None:
    """One line once both halves are up: the API listening and the jobs running (``jobs``
    False: the API alone, the jobs could not start)."""
    from api.tls import https_listener

    url = f"http://{settings.host}:{settings.port}"
    https = https_listener(settings)
    secure = f", https://{https[0]}:{https[1]}" if https else ""
    sql = (
        f"; deltaq sql on sc://127.0.0.1:{settings.spark_connect_port}"
        if settings.spark_connect_port
        else ""
    )
    tcp = f"; NSQ clients on {settings.host}:{settings.tcp_port}" if settings.tcp_port else ""
    if not jobs:
        log.info(
            "deltaq ready: %s%s (console %s/console)%s; no fanout, sweep or deltaq sql (see "
            "above); warehouse %s",
            url,
            secure,
            url,
            tcp,
            settings.warehouse,
        )
        return
    log.info(
        "deltaq ready: %s%s (console %s/console, API docs %s/docs)%s; fanout + sweep every "
        "%.0f s%s; warehouse %s",
        url,
        secure,
        url,
        url,
        tcp,
        settings.sweep_interval_s,
        sql,
        settings.warehouse,
    )
