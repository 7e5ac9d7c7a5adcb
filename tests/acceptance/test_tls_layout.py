"""TLS laid out as nsqd 1.3.0 lays it out, checked side by side with nsqd: plain HTTP stays on
its port, HTTPS is a listener of its own, TCP upgrades through IDENTIFY, and ``tls_required``
(false, true, tcp-https) gives a plaintext client what nsqd gives it. Then docs/operations.md's
recipe: NSQ's own tools over TCP with TLS, curl over HTTP and HTTPS."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from pyspark.sql import SparkSession

from queue_engine.spark.fanout_stream import start_fanout
from queue_engine.store.tables import Warehouse
from tests.conftest import HOST, Server, free_port
from tests.nsq_wire import Nsqd, Wire, sized, tool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ca = trustme.CA()
    issued = ca.issue_cert(HOST)
    where = tmp_path_factory.mktemp("certs")
    paths = {"cert": where / "cert.pem", "key": where / "key.pem", "ca": where / "ca.pem"}
    issued.private_key_and_cert_chain_pem.write_to_path(str(paths["cert"]))
    issued.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    return paths


def plain_tcp_pub(port: int) -> tuple[int, bytes] | None:
    """A PUB from a client that never upgraded to TLS: the first answer."""
    wire = Wire(port)
    try:
        wire.send(b"PUB plain\n" + sized(b"x"))
        return wire.frame()
    finally:
        wire.close()


def answers(http_port: int, https_port: int, tcp_port: int, ca: Path) -> list[object]:
    """What a plaintext HTTP client, an HTTPS client and a plaintext TCP client get."""
    plain = httpx.post(f"http://{HOST}:{http_port}/pub?topic=t", content=b"x", timeout=10)
    verify = ssl.create_default_context(cafile=str(ca))
    secure = httpx.post(
        f"https://{HOST}:{https_port}/pub?topic=t", content=b"x", verify=verify, timeout=10
    )
    return [
        (plain.status_code, plain.text),
        plain.headers.get("content-type"),
        (secure.status_code, secure.text),
        plain_tcp_pub(tcp_port),
    ]


@pytest.mark.parametrize("required", ["false", "true", "tcp-https"])
def test_tls_answers_match_nsqd(
    required: str, certs: dict[str, Path], server_factory: type[Server], tmp_path: Path
) -> None:
    nsqd_https = free_port()
    nsqd = Nsqd(tmp_path / "nsqd").start(
        f"--tls-cert={certs['cert']}",
        f"--tls-key={certs['key']}",
        f"--https-address={HOST}:{nsqd_https}",
        f"--tls-required={required}",
    )
    try:
        env = {
            "DELTAQ_TLS_CERT": str(certs["cert"]),
            "DELTAQ_TLS_KEY": str(certs["key"]),
            "DELTAQ_TLS_REQUIRED": required,
        }
        server = server_factory(tmp_path / "wh", env=env).start()
        ours = answers(server.port, server.https_port, server.tcp_port, certs["ca"])
        theirs = answers(nsqd.http_port, nsqd_https, nsqd.tcp_port, certs["ca"])
        # nsqd names its own HTTPS port in TLS_REQUIRED: compare with ours named the same.
        expected = [
            (
                (a[0], a[1].replace(str(nsqd_https), str(server.https_port)))
                if isinstance(a, tuple) and isinstance(a[1], str)
                else a
            )
            for a in theirs
        ]
        assert ours == expected
        info = httpx.get(f"https://{HOST}:{server.https_port}/info", verify=False).json()
        assert (info["http_port"], info["https_port"], info["tcp_port"]) == (
            server.port,
            server.https_port,
            server.tcp_port,
        )
        assert info["tls_required"] == required
    finally:
        nsqd.stop()


@pytest.fixture
def fanout_for(spark: SparkSession) -> Iterator[list[object]]:
    queries: list[object] = []
    yield queries
    for query in queries:
        query.stop()  # type: ignore[attr-defined]


def test_the_operations_recipe_nsq_tools_over_tls_and_curl(
    certs: dict[str, Path],
    server_factory: type[Server],
    tmp_path: Path,
    spark: SparkSession,
    fanout_for: list[object],
) -> None:
    env = {"DELTAQ_TLS_CERT": str(certs["cert"]), "DELTAQ_TLS_KEY": str(certs["key"])}
    server = server_factory(tmp_path / "wh", env=env).start()
    fanout_for.append(start_fanout(spark, Warehouse(str(tmp_path / "wh")), once=False))
    curl = ["curl", "-s", "--cacert", str(certs["ca"])]
    http = subprocess.run(
        [*curl, "-d", "over http", f"{server.http_url}/pub?topic=secure"],
        capture_output=True,
        text=True,
        check=True,
    )
    https = subprocess.run(
        [*curl, "-d", "over https", f"{server.https_url}/pub?topic=secure"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert (http.stdout, https.stdout) == ("OK", "OK")
    address = f"--nsqd-tcp-address={HOST}:{server.tcp_port}"
    published = subprocess.run(
        [
            str(tool("to_nsq")),
            address,
            "--topic=secure",
            "--producer-opt=tls_v1,true",
            f"--producer-opt=tls_root_ca_file,{certs['ca']}",
        ],
        input="over tcp and tls\n",
        text=True,
        check=False,
        timeout=60,
        capture_output=True,
    )
    assert published.returncode == 0, published.stderr
    tail = subprocess.run(
        [
            str(tool("nsq_tail")),
            address,
            "--topic=secure",
            "--channel=tail",
            "-n",
            "3",
            "--consumer-opt=tls_v1,true",
            f"--consumer-opt=tls_root_ca_file,{certs['ca']}",
        ],
        text=True,
        timeout=60,
        capture_output=True,
        check=False,
    )
    assert tail.returncode == 0, tail.stderr
    assert sorted(tail.stdout.splitlines()) == ["over http", "over https", "over tcp and tls"]
