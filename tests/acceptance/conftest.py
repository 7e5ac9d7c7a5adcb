"""Fixtures for modules that run consumers against the fanout stream (each module defines its
own ``server`` fixture, with the settings it needs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pyspark.sql import SparkSession

from deltaq.testing.s3 import S3Server, free_port, moto_server_command
from queue_engine.spark.fanout_loop import FanoutLoop
from queue_engine.spark.fanout_stream import start_fanout
from queue_engine.store.tables import Warehouse
from tests import power_cut
from tests.conftest import Server, unavailable

# The bucket the object-storage tests keep their warehouses in (each under its own prefix).
BUCKET = "deltaq-tests"


@pytest.fixture(scope="module")
def warehouse(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "wh"


@pytest.fixture(scope="module")
def fanout(spark: SparkSession, warehouse: Path) -> Iterator[None]:
    """The fanout query, running for the whole module (the servers come and go)."""
    query = start_fanout(spark, Warehouse(str(warehouse)), once=False)
    yield
    query.stop()


@pytest.fixture(scope="module")
def fanout_loop(warehouse: Path) -> Iterator[None]:
    """The fanout ``deltaq up`` runs on one machine (the loop: Spark's checkpoint and
    micro-batches without Spark) in this process, for the whole module. Modules whose subject
    is the API's behaviour take this one; Spark's own query (``fanout``) runs the modules about
    the Spark jobs and tests/spark/test_fanout.py, where both are held to the same rules."""
    loop = FanoutLoop(Warehouse(str(warehouse)), once=False).start()
    yield
    loop.stop()


@pytest.fixture(scope="module")
def loop_served(warehouse: Path) -> Iterator[Server]:
    """A server with the fanout ``deltaq up`` runs on one machine (the loop, without Spark) in
    this process, for the whole module: a module's ``server`` fixture may return it."""
    loop = FanoutLoop(Warehouse(str(warehouse)), once=False).start()
    server = Server(warehouse).start()
    yield server
    server.stop()
    loop.stop()


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    """A client of the module's server."""
    with httpx.Client(base_url=server.url, timeout=70) as c:
        yield c


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server as its own process on 127.0.0.1, with BUCKET created."""
    if moto_server_command() is None:
        unavailable("moto's S3 server is not installed (pip install 'moto[server]')")
    server = S3Server(free_port(), tmp_path_factory.mktemp("moto") / "moto.log").start()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[power_cut.PowerCutDisk]:
    """A power-cut file system mounted for the test (tests.power_cut)."""
    d = power_cut.PowerCutDisk(tmp_path).mount()
    yield d
    d.unmount()
