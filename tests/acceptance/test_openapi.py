"""/openapi.json tells the truth: schemathesis generates requests from it against a real API
(loopback, a bounded number of examples per operation) and finds no server error, no
response outside the schema or its documented statuses, and no schema-valid request
rejected."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, Server, unavailable

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "response_schema_conformance",
        "content_type_conformance",
        "negative_data_rejection",
        "positive_data_acceptance",
    ]
)


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("openapi") / "wh").start()
    yield server
    server.stop()


def test_api_matches_its_schema(api_server: Server, tmp_path: Path) -> None:
    binary = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if binary is None:
        unavailable("schemathesis is not installed (pip install -e '.[test]')")
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
        "PYTHONPATH": str(ROOT),
    }
    run = subprocess.run(
        [
            binary,
            "--config-file",
            str(ROOT / "tests" / "schemathesis.toml"),
            "run",
            f"{api_server.url}/openapi.json",
            "--checks",
            CHECKS,
            "--max-examples",
            "15",
            "--request-timeout",
            "30",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "generated" in run.stdout


def test_schema_states_the_contract(api_server: Server) -> None:
    spec = httpx.get(f"{api_server.url}/openapi.json").json()
    pub = spec["paths"]["/pub"]["post"]
    topic = next(p for p in pub["parameters"] if p["name"] == "topic")
    assert topic["required"] is True and topic["schema"]["maxLength"] == 64
    assert pub["requestBody"]["required"] is True
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
            bad = operation["responses"]["400"]["content"]["application/json"]["schema"]
            assert "INVALID_REQUEST" in bad["properties"]["message"]["enum"], (method, path)
