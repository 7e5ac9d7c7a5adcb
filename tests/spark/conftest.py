"""One local SparkSession for the whole test session (Spark starts in ~6 s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from queue_engine.spark.session import build_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session("local[2]", "deltaq-tests")
    yield session
    session.stop()
