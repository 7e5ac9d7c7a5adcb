"""``register_views(..., database=)`` with a relative warehouse path, as docs/tables.md shows
it (``"deltaq-data"``, where ``deltaq up`` keeps its tables): the catalog's entries point at
the tables themselves, not at a path under the database's directory."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pyspark.sql import SparkSession

from queue_engine.spark.session import Engine, delta_spark_package, engine
from queue_engine.spark.views import register_views
from tests.conftest import Server, unavailable


def test_a_relative_warehouse_enters_its_tables_by_their_own_location(
    spark: SparkSession,
    server_factory: type[Server],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if engine(spark) is not Engine.DELTA_SPARK:
        unavailable(f"delta-spark's jars ({delta_spark_package()}) could not be fetched or found")
    server = server_factory(tmp_path / "deltaq-data").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for body in (b"a", b"b", b"c"):
                assert http.post("/pub?topic=events", content=body).text == "OK"
    finally:
        server.stop()
    monkeypatch.chdir(tmp_path)
    register_views(spark, "deltaq-data", database="deltaq_relative")
    location = spark.sql("DESCRIBE DETAIL deltaq_relative.topic_events").first()
    assert location is not None
    assert location["location"].rstrip("/").endswith(str(tmp_path / "deltaq-data/topics/events"))
    history = spark.sql("DESCRIBE HISTORY deltaq_relative.topic_events").collect()
    assert history, "no history: the entry does not point at the Delta table"
    assert spark.table("deltaq_relative.topic_events").count() == 3
