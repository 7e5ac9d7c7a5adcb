"""deltaq up, the README's first command: the README's quick start pasted as written, the
settings reaching the jobs process, deltaq sql on deltaq up's Spark, and Ctrl-C stopping
everything cleanly."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import HOST, ROOT, free_port, run_bash

# A line deltaq's logging writes: "2026-11-25 08:46:41,051 INFO deltaq.up: ...".
DELTAQ_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) [\w.]+: ")


def quick_start(readme: str) -> str:
    """The shell blocks of the README's "Quick start" section, one after the other."""
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the quick start and its typed topic, headers and filters"
    return "\n".join(blocks)


def docs_examples(doc: str, sections: list[str]) -> str:
    """The bash blocks of the sections of ``doc`` whose headings start with ``sections``."""
    blocks = []
    for section in sections:
        text = doc.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
        blocks += re.findall(r"```bash\n(.*?)```", text, re.S)
    assert len(blocks) == len(sections), sections
    return "\n".join(blocks)


def tables_examples(doc: str) -> tuple[str, str]:
    """docs/tables.md's shell lines, and its Python blocks followed by its SQL queries run
    on their session, as one script."""
    [shell] = re.findall(r"```sh\n(.*?)```", doc, re.S)
    python = re.findall(r"```python\n(.*?)```", doc, re.S)
    [sql] = re.findall(r"```sql\n(.*?)```", doc, re.S)
    queries = [q.strip() for q in sql.split(";") if q.strip()]
    run = "\n".join(f"spark.sql({q!r}).collect()" for q in queries)
    script = "\n".join([*python, run, f"print('queries: {len(queries)}')"])
    return shell, script


def _wait_for(
    log_path: Path, pattern: str, seconds: float, process: subprocess.Popen[bytes]
) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if re.search(pattern, text):
            return text
        assert process.poll() is None, text[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not logged:\n{log_path.read_text(errors='replace')[-3000:]}")


@pytest.mark.slow
def test_up_runs_the_readme_quick_start_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port, connect_port, tcp_port = free_port(), free_port(), free_port()
    # A settings file given to deltaq up must reach its jobs process: a sweep interval no
    # default has, and the Spark Connect port deltaq sql then finds.
    config = tmp_path / "deltaq.toml"
    config.write_text(
        f"sweep_interval_s = 7.5\nspark_connect_port = {connect_port}\ntcp_port = {tcp_port}\n"
    )
    # A temporary directory of its own: where its Spark drivers keep their scratch files.
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path / "tmp")}
    env.pop("DELTAQ_CONFIG", None)
    env.pop("SPARK_LOCAL_DIRS", None)
    scratch_root = tmp_path / "tmp" / f"deltaq-spark-{os.getuid()}"
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "deltaq", "up", "--config", str(config), "--port", str(port)],
            cwd=tmp_path,  # the default warehouse, ./deltaq-data, as a new user has it
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        text = _wait_for(log_path, r"deltaq ready: ", 120, process)
        # deltaq's own lines only (Spark's and uvicorn's go to Spark's log file / --verbose).
        before_ready = text.split("deltaq ready: ", 1)[0].splitlines()
        foreign = [line for line in before_ready if not DELTAQ_LINE.match(line)]
        assert not foreign, "\n".join(before_ready)
        assert len(before_ready) <= 12, before_ready
        assert f"http://{HOST}:{port}" in text
        assert "fanout in this process and sweep (every 7.5 s)" in text, text[-3000:]
        assert f"sc://127.0.0.1:{connect_port}" in text
        assert f"NSQ clients on {HOST}:{tcp_port}" in text

        recipe = quick_start((ROOT / "README.md").read_text())
        recipe = recipe.replace("127.0.0.1:4151", f"{HOST}:{port}")
        recipe = recipe.replace(".venv/bin/deltaq ", f"{sys.executable} -m deltaq ")
        # The same settings as deltaq up's, through the environment this time.
        shell_env = {**env, "PYTHONPATH": str(ROOT), "DELTAQ_CONFIG": str(config)}
        shell = run_bash(recipe, tmp_path, shell_env, 180)
        out = shell.stdout
        assert '"lease":"1-' in out  # the /sub answer: one message, leased
        assert "OK" in out  # the /fin answer
        assert f"on the Spark at sc://127.0.0.1:{connect_port}" in shell.stderr
        # deltaq sql printed the ledger: one DELIVER and one FIN of the message.
        ledger = [line for line in out.splitlines() if "|events" in line.replace(" ", "")]
        events = sorted(e for line in ledger for e in re.findall(r"\b(DELIVER|FIN)\b", line))
        assert events == ["DELIVER", "FIN"], out
        # A typed topic and a filtered channel: the message the filter lets in comes with its
        # headers, the body that does not fit is refused, and SQL sums the typed field.
        assert '"headers":{"region":"eu"}' in out, out
        assert '{"message":"INVALID_BODY","reason":"field amount: expected DOUBLE' in out, out
        assert re.search(r"\|\s*A-1\s*\|\s*250\.0\s*\|", out), out
        assert re.search(r"\|\s*B-2\s*\|\s*12\.5\s*\|", out), out
        # The http-api.md examples of headers and filters, as written, on the same deltaq up.
        examples = docs_examples(
            (ROOT / "docs" / "http-api.md").read_text(),
            ["Headers", "Typed topics", "Filtered channels"],
        )
        examples = examples.replace("127.0.0.1:4151", f"{HOST}:{port}")
        docs_run = run_bash(examples, tmp_path, shell_env, 60)
        # The /pubs and the /mpubs answered OK; nothing answered an error ({"message": ...}).
        assert docs_run.stdout.count("OK") == 4, docs_run.stdout
        assert "message" not in docs_run.stdout, docs_run.stdout
        # docs/tables.md's examples, as written, over the same warehouse: its deltaq sql
        # lines, then its Python blocks and SQL queries in a fresh interpreter.
        shell_lines, python = tables_examples((ROOT / "docs" / "tables.md").read_text())
        shell_lines = shell_lines.replace("deltaq sql ", f"{sys.executable} -m deltaq sql ")
        out = run_bash(shell_lines, tmp_path, shell_env, 180).stdout
        assert re.search(r"\|\s*B-2\s*\|\s*12\.5\s*\|", out), out
        assert "A-1" not in out  # no placed_at: not in the sum since November
        assert re.search(r"\|\s*eu\s*\|\s*1\s*\|", out), out
        script = tmp_path / "tables_examples.py"
        script.write_text(python)
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={**shell_env, "PYSPARK_PYTHON": sys.executable},
            check=False,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "WRITE" in done.stdout  # DESCRIBE HISTORY of the topic's Delta table
        assert re.search(r"\|\s*DELIVER\s*\|\s*\d+\s*\|", done.stdout), done.stdout
        assert re.search(r"\|\s*events\s*\|\s*archive\s*\|", done.stdout), done.stdout
        assert "queries: 4" in done.stdout, done.stdout
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) as http:
            [topic] = http.get("/stats", params={"format": "json", "topic": "events"}).json()[
                "topics"
            ]
            [channel] = topic["channels"]
            assert (topic["depth"], channel["depth"], channel["in_flight_count"]) == (0, 0, 0)

        # A misspelt view: one line naming it, exit 1, no stack trace.
        typo = subprocess.run(
            [sys.executable, "-m", "deltaq", "sql", "SELECT * FROM ledgr"],
            cwd=tmp_path,
            env=shell_env,
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert typo.returncode == 1
        errors = [line for line in typo.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "ledgr" in errors[0], typo.stderr
        assert "Traceback" not in typo.stderr

        # The jobs process dies (kill -9): deltaq up starts it again and the fanout resumes.
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) as http:
            jobs = http.get("/info").json()["jobs"]
            assert jobs["state"] == "running" and jobs["restarts"] == 0
            dead = psutil.Process(jobs["pid"])
            doomed = [dead, *dead.children(recursive=True)]
            # Its Spark driver's scratch files: the copies of the jars, ~86 MB.
            [dead_scratch] = scratch_root.glob(f"{dead.pid}-*")
            assert _size(dead_scratch) > 10 << 20
            dead.kill()
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                jobs = http.get("/info").json()["jobs"]
                if jobs["restarts"] == 1 and jobs["state"] == "running":
                    break
                time.sleep(0.5)
            assert jobs["restarts"] == 1 and jobs["state"] == "running", jobs
            assert jobs["last_exit_code"] == -signal.SIGKILL and jobs["pid"] != dead.pid
            assert "deltaq_jobs_up 1.0" in http.get("/metrics").text
            assert http.get("/stats?format=json").json()["jobs"]["restarts"] == 1
            assert http.post("/pub?topic=events", content=b"after the restart").text == "OK"
            got = http.get(
                "/sub", params={"topic": "events", "channel": "archive", "wait_ms": 60000}
            ).json()["messages"]
            assert len(got) == 1
            body = "\n".join(f"{m['id']} {m['lease']}" for m in got)
            assert http.post("/fin?topic=events&channel=archive", content=body).text == "OK"
        _, orphans = psutil.wait_procs(doomed, timeout=60)
        assert not orphans, f"the killed jobs process left {orphans}"
        assert "exited with code -9; restarting" in log_path.read_text(errors="replace")
        # The next driver removed the killed one's scratch files.
        assert not dead_scratch.exists()
        assert list(scratch_root.glob(f"{jobs['pid']}-*"))

        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "the jobs process (fanout + sweep) was not started"
        # Ctrl-C in a terminal signals the foreground process group: deltaq up only, since
        # its jobs run in a session of their own; it stops them in order.
        process.send_signal(signal.SIGINT)
        assert process.wait(150) == 0, log_path.read_text(errors="replace")[-3000:]
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running: {alive}"
        # Stopped in order, the drivers took their copies of the jars with them.
        assert _size(scratch_root) < 1 << 20
        text = log_path.read_text(errors="replace")
        assert "Failed to cancel job group" not in text
        assert "INFO py4j" not in text
        # deltaq sql's queries left nothing in up's terminal: no Spark Connect stack traces,
        # no data source warnings.
        for noise in ("\tat org.apache", "SESSION_CLOSED", "replaced a previously", "WARN "):
            assert noise not in text, noise
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait(10)


@pytest.mark.slow
def test_up_without_java_serves_and_says_what_to_install(tmp_path: Path) -> None:
    """A Java too old for Spark: one line at start says what to install, the API serves,
    /info, /stats and the console say the jobs cannot start, and nothing restarts them."""
    home = tmp_path / "jdk-8"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "java").write_text(
        "#!/bin/sh\necho 'openjdk version \"1.8.0_402\" 2024-01-16' >&2\n"
    )
    (home / "bin" / "java").chmod(0o755)
    port, tcp_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAVA_HOME": str(home)}
    env.pop("DELTAQ_CONFIG", None)
    env["DELTAQ_SPARK_CONNECT_PORT"] = str(free_port())
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "deltaq", "up"),
                *("--port", str(port), "--tcp-port", str(tcp_port)),
            ],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        text = _wait_for(log_path, r"deltaq ready: ", 60, process)
        said = [line for line in text.splitlines() if "cannot start" in line]
        assert len(said) == 1, text
        assert "Java 17 or later" in said[0] and "is Java 8" in said[0], said
        assert "JAVA_HOME" in said[0], said
        assert "Traceback" not in text
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) as http:
            assert http.post("/pub?topic=events", content=b"served").text == "OK"
            jobs = http.get("/info").json()["jobs"]
            assert jobs["state"] == "failed" and "Java 17" in jobs["error"], jobs
            assert "Java 17" in http.get("/stats?format=json").json()["jobs"]["error"]
            assert "Java 17" in http.get("/console/api/overview").json()["jobs"]["error"]
            # Nothing was started, so nothing is restarted: the error stays.
            assert (jobs["pid"], jobs["last_exit_code"], jobs["restarts"]) == (None, None, 0)
        assert "restarting" not in log_path.read_text(errors="replace")
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def _size(path: Path) -> int:
    """Bytes of the files under ``path`` (a file removed while counting counts nothing)."""
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            if p.is_file():
                total += p.stat().st_size
    return total
