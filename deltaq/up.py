"""deltaq up: the API in this process, the jobs (fanout, sweep, Spark Connect) in a child."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

from jobs.command import SETTINGS_FROM_STDIN, settings_json
from queue_engine.settings import Settings

log = logging.getLogger("deltaq.up")


def up(settings: Settings) -> int:
    """Serve until Ctrl-C (or SIGTERM), then stop the child: the API answers waiting SUBs and
    commits what is pending, the child stops its stream and its sweep loop."""
    from api.server import serve

    if "://" not in settings.warehouse:
        # The child resolves paths from the same place, whatever its working directory.
        settings = settings.model_copy(update={"warehouse": os.path.abspath(settings.warehouse)})
    ready_read, ready_write = os.pipe()
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
        ],
        stdin=subprocess.PIPE,
        pass_fds=(ready_write,),
        # Its own session: a Ctrl-C in the terminal reaches this process only, which then
        # stops the child in order (a JVM interrupted mid-batch logs cancelled jobs).
        start_new_session=True,
    )
    os.close(ready_write)
    assert child.stdin is not None
    child.stdin.write(settings_json(settings).encode())
    child.stdin.close()
    api_started = threading.Event()
    threading.Thread(
        target=_announce_ready,
        args=(settings, ready_read, api_started, child.pid),
        daemon=True,
        name="deltaq-ready",
    ).start()
    log.info(
        "starting: API in pid %d, fanout + sweep on local Spark in pid %d, warehouse %s",
        os.getpid(),
        child.pid,
        settings.warehouse,
    )
    try:
        serve(settings, on_started=api_started.set)
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after its graceful shutdown
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(120)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.info("stopped")
    return 0


def _announce_ready(
    settings: Settings, ready_fd: int, api_started: threading.Event, child_pid: int
) -> None:
    """One line once both halves are up: the API listening and the jobs running."""
    with os.fdopen(ready_fd, "rb") as ready:
        jobs_ready = ready.readline().strip() == b"ready"
    if not jobs_ready:
        log.error("the jobs process (pid %d) stopped before it was ready", child_pid)
        return
    api_started.wait()
    scheme = "https" if settings.tls_cert and settings.tls_key else "http"
    url = f"{scheme}://{settings.host}:{settings.port}"
    sql = (
        f"; deltaq sql on sc://127.0.0.1:{settings.spark_connect_port}"
        if settings.spark_connect_port
        else ""
    )
    tcp = f"; NSQ clients on {settings.host}:{settings.tcp_port}" if settings.tcp_port else ""
    log.info(
        "deltaq ready: %s (console %s/console, API docs %s/docs)%s; fanout + sweep every %.0f s"
        "%s; warehouse %s",
        url,
        url,
        url,
        tcp,
        settings.sweep_interval_s,
        sql,
        settings.warehouse,
    )
