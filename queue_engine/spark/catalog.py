"""The queue's Delta tables as entries of a Spark catalog: ``CREATE TABLE ... USING delta
LOCATION`` for every topic and channel table, so that delta-spark users (and their catalog's
other clients) find them by name.

Spark's session catalog accepts only ``[A-Za-z0-9_]`` in table names, while NSQ's names may
also hold ``.``, ``-`` and ``#``: those become ``_``, and a name that would then clash with
another gets the first 8 hex digits of its own SHA-1. ``register_tables`` returns the mapping.

| table | name |
| --- | --- |
| ``topics/<t>`` | ``topic_<t>`` |
| ``channels/<t>/<c>/<kind>`` | ``channel_<t>__<c>_<kind>`` (messages, ledger, state, dead) |
| ``registry`` | ``registry`` |

Tables not created yet (a channel's ``state`` before its first sweep, ``dead`` before its first
dead letter) are left out; calling again adds them. Entries of tables that no longer exist are
dropped (``DROP TABLE`` of an external table leaves its files alone).
"""

from __future__ import annotations

import hashlib
import re

from pyspark.sql import SparkSession

from queue_engine.spark.session import Engine, delta_spark_package, engine, hadoop_path
from queue_engine.spark.views import read_registry
from queue_engine.store.delta import is_table
from queue_engine.store.tables import Warehouse

_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


class CatalogError(RuntimeError):
    """The tables cannot be entered in this session's catalog."""


def catalog_name(kind: str, *names: str) -> str:
    """The catalog name of a table: ``kind`` and NSQ ``names`` joined by ``__``, unsafe
    characters as ``_`` and, where any were replaced, the original's hash appended."""
    original = "__".join(names)
    safe = _UNSAFE.sub("_", original)
    if safe != original:
        safe += "_" + hashlib.sha1(original.encode()).hexdigest()[:8]
    return f"{kind}_{safe}"


def register_tables(
    spark: SparkSession, warehouse: str | Warehouse, database: str = "deltaq"
) -> dict[str, str]:
    """Create (or refresh) ``database`` with an external Delta table for every table of the
    warehouse; returns ``{qualified name: location}``. Needs delta-spark on ``spark``."""
    if engine(spark) is not Engine.DELTA_SPARK:
        raise CatalogError(
            "catalog entries are Delta tables: start the session with delta-spark "
            f"(configure_spark_with_delta_pip, or spark.jars.packages={delta_spark_package()})"
        )
    if _UNSAFE.search(database):
        raise CatalogError(f"database {database!r}: letters, digits and _ only")
    wh = (warehouse if isinstance(warehouse, Warehouse) else Warehouse(warehouse)).absolute()
    registry = read_registry(wh, None)
    wanted: dict[str, str] = {"registry": wh.registry_path}
    for topic in sorted(registry.topics.values(), key=lambda t: t.name):
        wanted[catalog_name("topic", topic.name)] = wh.topic_path(topic.name)
        for channel in sorted(topic.channels):
            prefix = catalog_name("channel", topic.name, channel)
            wanted[f"{prefix}_messages"] = wh.channel_messages_path(topic.name, channel)
            wanted[f"{prefix}_ledger"] = wh.channel_ledger_path(topic.name, channel)
            wanted[f"{prefix}_state"] = wh.channel_state_path(topic.name, channel)
            wanted[f"{prefix}_dead"] = wh.channel_dead_path(topic.name, channel)

    # Every table lives under the warehouse: ask Spark for its FileSystem once.
    root = hadoop_path(spark, wh.root)
    if root is None:
        raise CatalogError(f"{wh.root}: Spark has no Hadoop FileSystem for its scheme")
    spark.sql(f"CREATE DATABASE IF NOT EXISTS {database}")
    existing = {t.name for t in spark.catalog.listTables(database) if not t.isTemporary}
    registered: dict[str, str] = {}
    for name, path in wanted.items():
        if not is_table(path):
            continue
        # NSQ's names cannot hold a quote; a warehouse path might.
        location = (root + path.removeprefix(wh.root)).replace("'", "\\'")
        if name not in existing:
            spark.sql(f"CREATE TABLE {database}.{name} USING delta LOCATION '{location}'")
        registered[f"{database}.{name}"] = path
    ours = {n.split(".", 1)[1] for n in registered}
    for gone in sorted(existing - ours):
        if gone.startswith(("topic_", "channel_")):
            spark.sql(f"DROP TABLE IF EXISTS {database}.{gone}")
    return registered
