"""The whole pipeline on an S3 server (moto's, over HTTP on 127.0.0.1), and on local disk too
where the store changes the behaviour (the jobs' locks): the API publishing and leasing,
``deltaq fanout`` exactly once, ``deltaq sweep``, ``deltaq sql``, restarts and kill -9; and the
start checks that refuse a store deltaq cannot use safely.

Each command runs as a user runs it, a process of its own configured by the standard
``AWS_*`` variables. The fanout's checkpoint is the default, in the warehouse: on S3 a Spark
without the S3A connector runs it on a local copy mirrored to the store
(queue_engine.spark.checkpoint_mirror), and each ``fanout --once`` is a new process resuming
from the store's copy; with hadoop-aws from Maven (``spark_packages``) Spark writes
``s3a://`` itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from deltaq.testing.s3 import (
    S3Server,
    StoreProxy,
    free_port,
    moto_server_command,
    storage_options,
    store_env,
)
from queue_engine.spark.checkpoint_mirror import CheckpointMirror
from queue_engine.spark.session import hadoop_aws_package
from queue_engine.store.coordination import JobLock
from queue_engine.store.storage import read_whole
from queue_engine.store.tables import Warehouse
from tests.acceptance.conftest import BUCKET
from tests.conftest import ROOT, Server, run_bash, run_deltaq, unavailable, wait_until
from tests.consumers import answer, body, channel_stats, create_channel, sub

pytestmark = pytest.mark.slow


@dataclass
class Site:
    """Where one test's warehouse lives, and how processes reach it."""

    kind: str
    root: str  # the warehouse: a local path or an s3:// URL
    workdir: Path  # local files: logs
    env: dict[str, str]

    def table(self, path: str) -> pa.Table:
        options = storage_options(self.env) or None
        return DeltaTable(path, storage_options=options).to_pyarrow_table()

    def server(self, port: int = 0, **env: str) -> Server:
        """An API on the site; ``port``: restart a node where it was (its own address)."""
        return Server(
            self.workdir / "wh", env={**self.env, **env}, warehouse_url=self.root, port=port
        ).start()

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return deltaq(self.env, *args, "--warehouse", self.root)

    def fanout_once(self) -> subprocess.CompletedProcess[str]:
        done = self.run("fanout", "--once")
        assert done.returncode == 0, done.stderr[-3000:]
        return done


@pytest.fixture(params=["local", "s3"])
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Site:
    if request.param == "local":
        return Site("local", str(tmp_path / "wh"), tmp_path, {})
    s3: S3Server = request.getfixturevalue("s3_server")
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    # A short warehouse lease: an API restarted after kill -9 waits for the old one to lapse.
    return Site("s3", root, tmp_path, {**store_env(s3.endpoint), "DELTAQ_STORE_LEASE_S": "3"})


def deltaq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``deltaq <args>`` as its own process, with the store's variables ``env``."""
    return run_deltaq(*args, env={**os.environ, **env})


def publish(c: httpx.Client, topic: str, n: int, prefix: str) -> set[bytes]:
    sent = set()
    for i in range(n):
        payload = f"{prefix}-{i}".encode()
        assert c.post("/pub", params={"topic": topic}, content=payload).text == "OK"
        sent.add(payload)
    return sent


def take(c: httpx.Client, topic: str, channel: str, n: int, **params: Any) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got += sub(c, topic, channel, max=n - len(got), wait_ms=1000, **params)
    return got


# On local disk the same is proved by test_up, test_sweep_e2e and test_durability: here
# what the store changes (two round trips per commit, leases instead of flocks).
@pytest.mark.parametrize("site", ["s3"], indirect=True)
def test_publish_fanout_exactly_once_leases_sweep_and_sql(site: Site) -> None:
    server = site.server()
    wh = Warehouse(site.root)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        create_channel(c, "orders", "billing")
        sent = publish(c, "orders", 20, "pub")
        mpub = [f"mpub-{i}".encode() for i in range(30)]
        assert c.post("/mpub", params={"topic": "orders"}, content=b"\n".join(mpub)).text == "OK"
        sent |= set(mpub)
        # Deferred past the test's end: held back by its deferral, whatever the order of
        # delivery; and deferred 1.5 s, due long before the fanout is done.
        later, soon = b"deferred-1h", b"deferred-1.5s"
        r = c.post("/pub", params={"topic": "orders", "defer": 3_600_000}, content=later)
        assert r.text == "OK"
        r = c.post("/pub", params={"topic": "orders", "defer": 1500}, content=soon)
        assert r.text == "OK"
        soon_due = time.monotonic() + 1.5
        sent |= {later, soon}

        site.fanout_once()
        rows = site.table(wh.channel_messages_path("orders", "billing"))
        assert sorted(rows.column("body").to_pylist()) == sorted(sent)
        assert len(set(rows.column("id").to_pylist())) == len(sent)

        # Leases: FIN, REQ, TOUCH through the API over this store.
        time.sleep(max(0.0, soon_due - time.monotonic()))
        leased = take(c, "orders", "billing", 51, msg_timeout_ms=30_000)
        assert len(leased) == 51
        # All but the one deferred for an hour, which is not due: asked for more, the channel
        # has nothing to give.
        assert later not in {body(m) for m in leased}
        assert sub(c, "orders", "billing", max=10, wait_ms=1000) == []
        assert soon in {body(m) for m in leased}
        plain = [m for m in leased if body(m) != soon]
        [due] = [m for m in leased if body(m) == soon]
        fin, req, touch = [*plain[:40], due], plain[40:45], plain[45]
        assert answer(c, "fin", "orders", "billing", *fin).text == "OK"
        assert answer(c, "req", "orders", "billing", *req, timeout_ms=0).text == "OK"
        assert answer(c, "touch", "orders", "billing", touch).text == "OK"
        again = take(c, "orders", "billing", 5, msg_timeout_ms=30_000)
        by_body = {body(m): m for m in again}
        assert set(by_body) == {body(m) for m in req}
        assert {by_body[body(m)]["attempts"] for m in req} == {2}
        assert answer(c, "fin", "orders", "billing", *again).text == "OK"
        stats = channel_stats(c, "orders", "billing")
        # 4 of plain[46:] and touch in flight; the hour-long deferral still waiting.
        assert (stats["depth"], stats["in_flight_count"], stats["deferred_count"]) == (0, 5, 1)
    server.stop()

    swept = site.run("sweep")
    assert swept.returncode == 0, swept.stderr[-3000:]
    assert "swept 1 channels" in swept.stderr
    answer_rows = site.run(
        "sql",
        "--local",
        "SELECT topic, channel, event, count(*) AS n FROM ledger GROUP BY 1, 2, 3",
    )
    assert answer_rows.returncode == 0, answer_rows.stderr[-3000:]
    # Each answer in the ledger: 46 FINs, the 5 REQs and the TOUCH.
    out = answer_rows.stdout.replace(" ", "")
    for event, n in (("FIN", 46), ("REQ", 5), ("TOUCH", 1)):
        assert f"|orders|billing|{event}|{n}|" in out, out


@pytest.mark.timeout(420)  # moto, the API and two Spark starts on a busy machine
def test_deploy_mds_recipe_on_moto_runs_as_written(tmp_path: Path) -> None:
    """docs/deploy.md's "To try it on one machine", pasted into a shell: moto's server, a
    bucket, ``deltaq api`` on it, a publish, the fanout and SQL. Only the ports differ (free
    ones, for moto's server and the API)."""
    if moto_server_command() is None:
        unavailable("moto's S3 server is not installed (pip install 'moto[server]')")
    doc = (ROOT / "docs" / "deploy.md").read_text()
    [recipe] = re.findall(r"```sh\n(\.venv/bin/pip install 'moto.*?)```", doc, re.S)
    moto, api, tcp = free_port(), free_port(), free_port()
    script = (
        recipe.replace(":5000", f":{moto}")
        .replace("-p 5000", f"-p {moto}")
        .replace("127.0.0.1:4151", f"127.0.0.1:{api}")
        .replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    )
    assert str(moto) in script and str(api) in script, script
    config = tmp_path / "deltaq.toml"
    config.write_text(f"port = {api}\ntcp_port = {tcp}\n")
    # The recipe's own AWS_ exports only.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # The recipe's pip finds its packages installed: it reaches no index.
    env |= {
        "DELTAQ_CONFIG": str(config),
        "PYTHONPATH": str(ROOT),
        "PIP_NO_INDEX": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    # moto's server and the API run in the background, as the recipe starts them: stopped
    # when the script ends, however it ends, the API first (it stops against a live store).
    stop = (
        "trap 'for job in $(jobs -p | tac); do"
        " kill $job 2>/dev/null || true; wait $job 2>/dev/null || true; done' EXIT\n"
    )
    out = run_bash(stop + script, tmp_path, env, 360).stdout
    # The publish's answer starts a line (pip's lines before it say what it found installed;
    # the readiness waits print nothing).
    assert re.search(r"(?m)^OK", out), out
    [row] = [line for line in out.splitlines() if "|orders|" in line.replace(" ", "")]
    assert "|1|" in row.replace(" ", ""), out  # message_count: the one published


# On local disk the same is proved by test_up, test_sweep_e2e and test_durability: here
# what the store changes (two round trips per commit, leases instead of flocks).
@pytest.mark.parametrize("site", ["s3"], indirect=True)
def test_restarts_and_kill_9_lose_nothing_acknowledged(site: Site, s3_server: S3Server) -> None:
    """Also: without S3A on the jobs' classpath the fanout mirrors its checkpoint to the store
    from a local copy, and its second run (a new process) resumes from it: nothing twice."""
    wh = Warehouse(site.root)
    server = site.server()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        create_channel(c, "events", "worker")
        sent = publish(c, "events", 40, "before")
    site.fanout_once()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        # Leases of ten minutes: still held at the end, however long the restarts take.
        leased = take(c, "events", "worker", 10, msg_timeout_ms=600_000)
        assert len(leased) == 10
        assert answer(c, "fin", "events", "worker", *leased[:4]).text == "OK"
    server.kill9()

    # A restarted API knows the 4 FINs and the 6 leases it had handed out (they come back when
    # their time is up); what was acknowledged before kill -9 is all there. (Restarted at its
    # address: on the store it takes back its own lane, and with it the channel, at once.)
    server = site.server(server.port)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        stats = channel_stats(c, "events", "worker")
        assert (stats["depth"], stats["in_flight_count"]) == (30, 6)
        sent |= publish(c, "events", 40, "after")
    server.kill9()

    # The restarted API commits what its journal (objects in the store) acknowledged, first.
    server = site.server(server.port)
    topic_rows = site.table(wh.topic_path("events"))
    assert sorted(topic_rows.column("body").to_pylist()) == sorted(sent)
    done = site.fanout_once()
    assert f"fanout checkpoint {site.root}/_checkpoints/fanout: " in done.stderr, done.stderr
    stored = s3_server.keys(BUCKET, f"{site.root.split('/', 3)[3]}/_checkpoints/fanout/")
    assert {"metadata", "offsets/0", "commits/0", "offsets/1", "commits/1"} <= stored, stored
    assert not any(k.rsplit("/", 1)[-1].startswith(".") for k in stored), stored
    with httpx.Client(base_url=server.url, timeout=30) as c:
        rest = take(c, "events", "worker", 70, msg_timeout_ms=60_000)
        fin_ids = {m["id"] for m in leased[:4]}
        assert not fin_ids & {m["id"] for m in rest}
        # 30 + 40 new, each once; the 6 leased are still in flight.
        assert sorted(body(m) for m in rest) == sorted(sent - {body(m) for m in leased})
        assert channel_stats(c, "events", "worker")["in_flight_count"] == 76
        assert answer(c, "fin", "events", "worker", *rest).text == "OK"
        assert sub(c, "events", "worker", max=10, wait_ms=500) == []
    server.stop()


def _api_error(env: dict[str, str], root: str) -> subprocess.CompletedProcess[str]:
    return deltaq(env, "api", "--warehouse", root, "--port", str(free_port()))


def test_a_store_deltaq_cannot_use_stops_each_command_with_one_line(s3_server: S3Server) -> None:
    env = store_env(s3_server.endpoint)
    root = f"s3://{BUCKET}/refused"
    cases: list[tuple[dict[str, str], str, str]] = [
        (env, f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/wh", "NoSuchBucket"),
        ({**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}, root, "error sending"),
    ]
    proxy = StoreProxy(s3_server.port, strip_conditional=True).start()
    try:
        cases.append((store_env(proxy.endpoint), root, "put-if-absent"))
        for case_env, case_root, expected in cases:
            done = _api_error(case_env, case_root)
            assert done.returncode == 1, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1, done.stderr
            assert lines[0].startswith(f"deltaq api: error: warehouse {case_root}")
            assert expected in lines[0]
        # The jobs' commands check the store the same way, before any Spark starts.
        for command in (["fanout", "--once"], ["sweep"], ["sql", "--local", "SELECT 1"]):
            done = deltaq(store_env(proxy.endpoint), *command, "--warehouse", root)
            assert done.returncode == 1, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1, done.stderr
            assert lines[0].startswith(f"deltaq {command[0]}: error: warehouse {root}"), lines
            assert "put-if-absent" in lines[0]
    finally:
        proxy.stop()


def test_wrong_credentials_are_refused_at_start(tmp_path: Path) -> None:
    if moto_server_command() is None:
        unavailable("moto's S3 server is not installed (pip install 'moto[server]')")
    # moto checks signatures against its known users once its free actions are used up.
    no_free_actions = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    server = S3Server(free_port(), tmp_path / "moto.log", env=no_free_actions).start()
    try:
        done = _api_error(store_env(server.endpoint), f"s3://{BUCKET}/wh")
        assert done.returncode == 1
        assert done.stderr.startswith(f"deltaq api: error: warehouse s3://{BUCKET}/wh")
        assert "InvalidAccessKeyId" in done.stderr
    finally:
        server.stop()


def test_the_fanout_checkpoint_lives_in_the_store_through_s3a(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """With hadoop-aws on the jobs' classpath (``spark_packages``, fetched from Maven Central
    into Ivy's cache) Spark keeps the fanout's checkpoint on ``s3a://`` itself, configured
    from the same store variables as delta-rs, and a second run (a new process) resumes from
    it: nothing twice. (Without S3A the checkpoint is mirrored to the store:
    test_restarts_and_kill_9_lose_nothing_acknowledged.)"""
    env = store_env(s3_server.endpoint)
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    env["DELTAQ_SPARK_PACKAGES"] = json.dumps([hadoop_aws_package()])
    args = [
        "fanout",
        "--once",
        "--checkpoint",
        f"s3a://{root.split('://', 1)[1]}/_checkpoints/fanout",
    ]
    site = Site("s3", root, tmp_path, env)
    server = site.server()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            create_channel(c, "t", "c")
            first = publish(c, "t", 5, "first")
            done = site.run(*args)
            if done.returncode != 0 and "UNRESOLVED DEPENDENC" in done.stderr:
                unavailable(f"{hadoop_aws_package()} could not be fetched from Maven Central")
            assert done.returncode == 0, done.stderr[-3000:]
            second = publish(c, "t", 5, "second")
        done = site.run(*args)
        assert done.returncode == 0, done.stderr[-3000:]
        # Spark wrote it: nothing was mirrored.
        assert f"fanout checkpoint {root}/_checkpoints/fanout: " not in done.stderr
    finally:
        server.stop()
    rows = site.table(Warehouse(root).channel_messages_path("t", "c"))
    assert sorted(rows.column("body").to_pylist()) == sorted(first | second)
    stored = s3_server.keys(BUCKET, f"{root.split('/', 3)[3]}/_checkpoints/fanout/")
    assert {"metadata", "offsets/0", "commits/0", "offsets/1", "commits/1"} <= stored, stored
    assert not any(k.rsplit("/", 1)[-1].startswith(".") for k in stored), stored


def test_a_mirrored_checkpoint_follows_what_spark_writes_and_purges(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in store_env(s3_server.endpoint).items():
        monkeypatch.setenv(name, value)
    prefix = f"{uuid.uuid4().hex[:12]}/cp"
    mirror = CheckpointMirror(f"s3://{BUCKET}/{prefix}")
    assert mirror.restore() == 0
    local = Path(mirror.local)
    for name, text in [("metadata", "m"), ("offsets/0", "o0"), ("offsets/.0.crc", "x")]:
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_text(text)
    assert mirror.push() == 2  # not Hadoop's checksum file
    assert mirror.push() == 0  # nothing changed
    (local / "commits").mkdir()
    (local / "commits/0").write_text("c0")
    (local / "offsets/1").write_text("o1")
    (local / "offsets/0").unlink()  # Spark purged an old batch
    assert mirror.push() == 2
    assert s3_server.keys(BUCKET, f"{prefix}/") == {"metadata", "commits/0", "offsets/1"}
    mirror.close()
    assert not local.exists()

    again = CheckpointMirror(f"s3://{BUCKET}/{prefix}")
    assert again.restore() == 3
    assert (Path(again.local) / "offsets/1").read_text() == "o1"
    again.close()


def test_one_fanout_and_one_sweep_per_warehouse(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second fanout (or sweep) on a warehouse refuses, naming the running one; once that
    is killed -9 the lock is free again (on the store once the killed one's lease lapsed).
    (That a fanout run after a kill -9 copies each message once: test_fanout.py locally,
    test_spark_cluster.py on the store.)"""
    for name, value in site.env.items():  # this process reads and takes the locks
        monkeypatch.setenv(name, value)
    server = site.server()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        create_channel(c, "t", "c")
    server.stop()
    log = site.workdir / "fanout-1.log"
    with open(log, "wb") as out:
        first = subprocess.Popen(
            [sys.executable, "-m", "deltaq", "fanout", "--warehouse", site.root],
            env={**os.environ, **site.env},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    lock = JobLock(site.root, "fanout", lease_s=3)
    try:
        deadline = time.monotonic() + 120
        holder: dict[str, Any] = {}
        while holder.get("pid") != first.pid:  # running: it holds the lock (before its Spark)
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
            with contextlib.suppress(Exception):
                holder = json.loads(read_whole(lock.url) or b"{}")
        second = site.run("fanout", "--once")
        assert second.returncode == 1
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(
            f"deltaq fanout: error: another fanout runs on warehouse {site.root} (pid {first.pid}"
        ), last
    finally:
        first.kill()
        first.wait(30)
    lock.acquire()  # local: at once; on the store: once the killed holder's lease lapsed
    lock.release()

    for name, value in site.env.items():  # this process holds the sweep's lock
        monkeypatch.setenv(name, value)
    lock = JobLock(site.root, "sweep", lease_s=3).acquire()
    try:
        swept = site.run("sweep")
    finally:
        lock.release()
    assert swept.returncode == 1
    assert "error: another sweep runs on warehouse" in swept.stderr.strip().splitlines()[-1]


def test_an_az_warehouse_is_refused_with_one_line() -> None:
    done = _api_error({}, "az://container/wh")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "deltaq api: error: warehouse az://container/wh: az:// warehouses are not supported "
        "(pyarrow, which deltaq reads files with, has no filesystem for az://)"
    )


def test_fanout_refuses_a_checkpoint_nothing_can_write(s3_server: S3Server) -> None:
    env = store_env(s3_server.endpoint)
    args = ["fanout", "--once", "--warehouse", f"s3://{BUCKET}/ck", "--checkpoint", "nowhere://x"]
    done = deltaq(env, *args)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("deltaq fanout: error: Spark has no Hadoop FileSystem for nowhere://")
    assert "--checkpoint" in last


def test_a_store_outage_under_load_answers_503_and_loses_nothing_acknowledged(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The store goes away while 4 producers publish (the proxy drops every request,
    as an unreachable endpoint does; moto keeps its objects only in memory, so it is the
    proxy that stops, not moto). Publishes answer 503 E_COMMIT_FAILED meanwhile, the API
    recovers by itself, and every acknowledged message is in the topic table."""
    proxy = StoreProxy(s3_server.port).start()
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    site = Site("s3", root, tmp_path, store_env(proxy.endpoint))
    server = site.server()
    acked: list[bytes] = []
    refused: list[str] = []
    stop = threading.Event()

    def produce(worker: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            i = 0
            while not stop.is_set():
                payload = f"w{worker}-{i}".encode()
                r = c.post("/pub", params={"topic": "load"}, content=payload)
                if r.status_code == 200:
                    acked.append(payload)
                else:
                    refused.append(f"{r.status_code} {r.text}")
                i += 1

    producers = [threading.Thread(target=produce, args=(w,)) for w in range(4)]
    try:
        for t in producers:
            t.start()
        wait_until(lambda: len(acked) >= 10, "publishes acknowledged before the outage")
        before = len(acked)
        proxy.down = True
        # Until the store errors outlast the clients' retries and a publish is refused (a few
        # seconds, depending on where each commit's retries stand), at most 20 s.
        wait_until(lambda: bool(refused), "a publish refused during the outage", 20)
        time.sleep(1.0)  # refusals go on while the store stays away
        at_recovery = len(acked)
        proxy.down = False
        # The API recovers by itself: publishes are acknowledged again.
        wait_until(lambda: len(acked) >= at_recovery + 10, "publishes acknowledged after it")
        stop.set()
        for t in producers:
            t.join(60)
    finally:
        stop.set()
        server.stop()
        proxy.stop()
    assert before >= 10 and len(acked) >= at_recovery + 10
    assert refused and set(refused) == {'503 {"message":"E_COMMIT_FAILED"}'}
    # Read straight from the store, not through the proxy.
    direct = Site("s3", root, tmp_path, store_env(s3_server.endpoint))
    stored = direct.table(Warehouse(root).topic_path("load")).column("body").to_pylist()
    assert set(acked) <= set(stored)
    assert all(len(b) > 0 for b in stored)


def test_deleting_many_objects_takes_one_request(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the journal's truncation and the checkpoint mirror delete goes in one S3
    DeleteObjects request, not one request per object; a key already gone is no error."""
    from queue_engine.store.storage import object_store

    trace: list[str] = []
    proxy = StoreProxy(s3_server.port, trace=trace).start()
    try:
        for key, value in store_env(proxy.endpoint).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(object_store, "_stores", {})
        root = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
        urls = [f"{root}/o{i}" for i in range(40)]
        object_store.put_objects([(url, b"x") for url in urls])
        trace.clear()
        object_store.delete_objects([*urls, f"{root}/never-written"])
        assert [line.split(" ")[:2] for line in trace] == [["POST", f"/{BUCKET}?delete"]]
        assert object_store.list_objects(root) == []
    finally:
        proxy.stop()
