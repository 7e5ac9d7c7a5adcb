"""Which Delta table features deltaq keeps working with, and the refusal of a table that uses
one it does not.

Another engine (delta-spark above all) may change a table's protocol or metadata while deltaq
writes it. deltaq writes through its own appenders (reader 1, writer <= 2, no features),
otherwise through delta-rs; it tails topic tables by reading their commits and data files
itself. A feature neither can honour makes that one table *refused*: publishes to it are
answered ``E_TABLE_REFUSED`` naming the feature, ``/stats`` and ``/info`` show it, the fanout
holds the topic where it is, and every other table goes on.

Measured with delta-rs 1.6 and delta-spark 4.4 (``ALTER TABLE ... SET TBLPROPERTIES`` on a table
delta-rs created, then a delta-rs append): appends work with appendOnly, CHECK constraints,
change data feed, deletion vectors, column mapping and v2 checkpoints; they are refused
("Unsupported table features required") with In-Commit Timestamps, row tracking (and its
domain metadata) and type widening.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from deltalake import DeltaTable

# Writer features delta-rs appends honour (see above); any other is a refusal.
DELTA_RS_WRITER_FEATURES = frozenset(
    {
        "appendOnly",
        "invariants",
        "checkConstraints",
        "changeDataFeed",
        "generatedColumns",
        "timestampNtz",
        "deletionVectors",
        "columnMapping",
        "v2Checkpoint",
        "vacuumProtocolCheck",
    }
)
# Reader features that change what a data file's rows are, which deltaq's own readers (the
# fanout's tailer, the channel readers) do not apply: deletion vectors hide rows of a file,
# type widening changes a column's type after the file was written, variant is a type
# deltaq's schemas do not have. Column mapping is checked by its physical names instead.
UNREAD_READER_FEATURES = frozenset({"deletionVectors", "typeWidening", "variantType"})

_WHY = {
    "deletionVectors": "deletion vectors hide rows of data files, and deltaq reads the files "
    "itself; turn them off ('delta.enableDeletionVectors'='false', then ALTER TABLE ... DROP "
    "FEATURE deletionVectors)",
    "typeWidening": "a widened column no longer matches deltaq's schema",
    "variantType": "deltaq's schemas have no variant column",
    "inCommitTimestamp": "delta-rs cannot write commits with In-Commit Timestamps",
    "rowTracking": "delta-rs cannot write commits with row tracking",
    "domainMetadata": "delta-rs cannot write commits with domain metadata",
    "columnMapping": "a column was renamed or dropped: its data files name it otherwise",
}


class TableRefusedError(RuntimeError):
    """deltaq cannot keep working with this table; ``feature`` names why."""

    def __init__(self, path: str, feature: str, detail: str = "") -> None:
        why = detail or _WHY.get(feature, "deltaq does not implement it")
        super().__init__(f"{path}: the table uses {feature}: {why}")
        self.path = path
        self.feature = feature
        self.reason = f"{feature}: {why}"


def protocol_refusal(
    reader_features: Iterable[str] | None,
    writer_features: Iterable[str] | None,
    min_writer_version: int,
) -> str | None:
    """The feature of a protocol deltaq cannot keep working with (None: none)."""
    readers = set(reader_features or ())
    for feature in sorted(readers & UNREAD_READER_FEATURES):
        return feature
    writers = set(writer_features or ())
    for feature in sorted(writers - DELTA_RS_WRITER_FEATURES):
        return feature
    # Writer versions 3-6 without a feature list imply their features: 4 adds change data feed
    # and generated columns, 5 column mapping, 6 identity columns (which delta-rs cannot write).
    if not writers and min_writer_version >= 6:
        return "identityColumns"
    return None


def schema_refusal(schema_json: str | Mapping[str, Any] | None, mode: str | None) -> str | None:
    """ "columnMapping" when a column's physical name differs from its name (a rename or drop
    under column mapping): deltaq's readers find columns in data files by name."""
    if not mode or mode == "none" or schema_json is None:
        return None
    schema = json.loads(schema_json) if isinstance(schema_json, str) else schema_json
    for field in schema.get("fields", []):
        physical = (field.get("metadata") or {}).get("delta.columnMapping.physicalName")
        if physical is not None and physical != field.get("name"):
            return "columnMapping"
    return None


def table_refusal(dt: DeltaTable) -> str | None:
    """The feature of the table (as loaded in ``dt``) deltaq cannot keep working with."""
    protocol = dt.protocol()
    refused = protocol_refusal(
        protocol.reader_features, protocol.writer_features, protocol.min_writer_version
    )
    if refused is not None:
        return refused
    configuration = dt.metadata().configuration
    return schema_refusal(dt.schema().to_json(), configuration.get("delta.columnMapping.mode"))


def commit_refusal(actions: Iterable[Mapping[str, Any]]) -> str | None:
    """The feature one commit's actions bring that deltaq's readers cannot follow: a protocol
    action with such a feature, column mapping that renamed a column, or a file added with a
    deletion vector."""
    for action in actions:
        if (protocol := action.get("protocol")) is not None:
            refused = protocol_refusal(
                protocol.get("readerFeatures"),
                protocol.get("writerFeatures"),
                int(protocol.get("minWriterVersion", 2)),
            )
            if refused is not None:
                return refused
        elif (metadata := action.get("metaData")) is not None:
            mode = (metadata.get("configuration") or {}).get("delta.columnMapping.mode")
            refused = schema_refusal(metadata.get("schemaString"), mode)
            if refused is not None:
                return refused
        elif (add := action.get("add")) is not None and add.get("deletionVector"):
            return "deletionVectors"
    return None


def append_only(dt: DeltaTable) -> bool:
    """Whether the table forbids removing data (``delta.appendOnly``): retention leaves it."""
    value = dt.metadata().configuration.get("delta.appendOnly", "false")
    return str(value).lower() == "true"


def check_constraints(dt: DeltaTable) -> dict[str, str]:
    """The table's CHECK constraints, name -> expression."""
    prefix = "delta.constraints."
    return {
        key[len(prefix) :]: value
        for key, value in dt.metadata().configuration.items()
        if key.startswith(prefix) and value is not None
    }


_UNSUPPORTED = re.compile(r"Unsupported table features required: \[([^\]]*)\]")


def unsupported_features(message: str) -> list[str] | None:
    """The features delta-rs named in its "Unsupported table features required" error."""
    match = _UNSUPPORTED.search(message)
    if match is None:
        return None
    names = [name.strip() for name in match.group(1).split(",") if name.strip()]
    # delta-rs names them in its enum's spelling (InCommitTimestamp): the protocol's is
    # lower camel case.
    return [name[:1].lower() + name[1:] for name in names]
