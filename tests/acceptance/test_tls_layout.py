"""TLS laid out as nsqd 1.3.0 lays it out, checked side by side with nsqd: plain HTTP stays on
its port, HTTPS is a listener of its own, TCP upgrades through IDENTIFY, and ``tls_required``
(false, true, tcp-https) gives a plaintext client what nsqd gives it. Then docs/operations.md's
recipe: NSQ's own tools over TCP with TLS, curl over HTTP and HTTPS."""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path

import httpx
import pytest
import trustme

from queue_engine.spark.fanout_loop import FanoutLoop
from queue_engine.store.tables import Warehouse
from tests.conftest import HOST, ROOT, Server, free_port, run_bash
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


def test_the_operations_recipe_runs_as_written(
    server_factory: type[Server], tmp_path: Path
) -> None:
    """docs/operations.md's TLS recipe pasted into a shell: its openssl certificate, curl over
    HTTP and HTTPS, NSQ's to_nsq and nsq_tail over TLS. Its ``deltaq up`` line is the one not
    pasted: the test's API takes the certificate and key the recipe made, with the fanout
    ``deltaq up`` runs (the loop), on free ports."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    [recipe] = re.findall(r"```sh\n(openssl req .*?)```", doc, re.S)
    lines = recipe.splitlines()
    [up] = [i for i, line in enumerate(lines) if "deltaq up" in line]
    assert lines[up] == ".venv/bin/deltaq up --tls-cert cert.pem --tls-key key.pem &"
    run_bash("\n".join(lines[:up]), tmp_path, dict(os.environ), 60)
    env = {
        "DELTAQ_TLS_CERT": str(tmp_path / "cert.pem"),
        "DELTAQ_TLS_KEY": str(tmp_path / "key.pem"),
    }
    server = server_factory(tmp_path / "wh", env=env).start()
    loop = FanoutLoop(Warehouse(str(tmp_path / "wh")), once=False).start()
    try:
        script = (
            "\n".join(lines[up + 1 :])
            .replace("127.0.0.1:4151", f"{HOST}:{server.port}")
            .replace("127.0.0.1:4152", f"{HOST}:{server.https_port}")
            .replace("127.0.0.1:4150", f"{HOST}:{server.tcp_port}")
        )
        tools = {tool("to_nsq").parent, tool("nsq_tail").parent}
        path = ":".join([*map(str, tools), os.environ["PATH"]])
        out = run_bash(script, tmp_path, {**os.environ, "PATH": path}, 120).stdout
    finally:
        loop.stop()
    # The two curls' answers, then what nsq_tail received over TLS.
    assert out.startswith("OKOK"), out
    assert sorted(out[4:].splitlines()) == ["over http", "over https", "over tcp and tls"]
