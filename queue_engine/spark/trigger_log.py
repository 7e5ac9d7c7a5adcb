"""One log line per fanout trigger that ran a micro-batch: its whole duration and where it went.

A batch's own line (``fanout batch N``) times its read and write only; a message also waits
for the trigger's planning (probing the topics for new versions) and Spark's offset and commit
logs, which this line shows.

Why not PySpark's ``StreamingQueryListener`` as it comes: before calling the listener it
converts each progress event field by field over py4j (dozens of round trips), which took a
fifth of the fanout driver's Python time under load, competing with the channel writes. Here
the same Java listener interface gets the event and reads its progress as one JSON string.
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar

from pyspark import SparkContext
from pyspark.sql.streaming.listener import (
    QueryIdleEvent,
    QueryProgressEvent,
    QueryStartedEvent,
    QueryTerminatedEvent,
    StreamingQueryListener,
)

log = logging.getLogger(__name__)


class _ProgressAsJson:
    """The py4j side of the listener: Spark calls it with Java events."""

    def __init__(self, query_name: str) -> None:
        self.query_name = query_name

    def onQueryStarted(self, jevent: Any) -> None:
        return None

    def onQueryProgress(self, jevent: Any) -> None:
        progress = json.loads(jevent.progress().json())
        durations = progress.get("durationMs", {})
        # A trigger that ran a batch times its addBatch (numInputRows stays 0 where the
        # fanout's driver reads the batch's rows itself).
        if progress.get("name") != self.query_name or "addBatch" not in durations:
            return
        log.info(
            "fanout trigger %d: %d ms (latestOffset %d, addBatch %d, walCommit %d, "
            "commitOffsets %d)",
            progress.get("batchId", -1),
            durations.get("triggerExecution", 0),
            durations.get("latestOffset", 0),
            durations.get("addBatch", 0),
            durations.get("walCommit", 0),
            durations.get("commitOffsets", 0),
        )

    def onQueryIdle(self, jevent: Any) -> None:
        return None

    def onQueryTerminated(self, jevent: Any) -> None:
        return None

    class Java:
        implements: ClassVar[list[str]] = [
            "org.apache.spark.sql.streaming.PythonStreamingQueryListener"
        ]


class TriggerLog(StreamingQueryListener):
    """Registered with ``spark.streams.addListener`` (which starts py4j's callback server);
    Spark talks to ``_ProgressAsJson`` instead of PySpark's converting wrapper."""

    def __init__(self, query_name: str) -> None:
        self._callback = _ProgressAsJson(query_name)

    @property
    def _jlistener(self) -> Any:
        if not hasattr(self, "_jlistenerobj"):
            jvm = SparkContext._jvm
            assert jvm is not None
            self._jlistenerobj = jvm.PythonStreamingQueryListenerWrapper(self._callback)
        return self._jlistenerobj

    # PySpark's interface, unused: Spark calls the callback above.
    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        return None

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        return None

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        return None

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        return None
