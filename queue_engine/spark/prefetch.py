"""The one private PySpark class deltaq builds on, checked before it is used.

Spark sends the rows a *simple* stream reader produced in its driver-side Python process to the
JVM with the micro-batch's plan, so a small micro-batch runs without a Python task (measured:
a Python read task cost ~100 ms of each fanout micro-batch). PySpark recognises such readers
by ``isinstance(reader, _SimpleStreamReaderWrapper)`` (pyspark.sql.datasource_internal), so
the topics stream's hybrid reader subclasses that wrapper. It is private: where it is missing
or no longer has what the hybrid reader uses (its ``cache`` of prefetched batches,
``add_result_to_cache``, ``simple_reader``), ``PREFETCH_SUPPORTED`` is False and the topics
stream reads every micro-batch in Python tasks instead — slower at low rates, never wrong.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

try:
    from pyspark.sql import datasource_internal as _internal
except ImportError:  # pragma: no cover - a PySpark without the Python Data Source internals
    _internal = None  # type: ignore[assignment]


def _usable(module: Any) -> bool:
    wrapper = getattr(module, "_SimpleStreamReaderWrapper", None)
    partition = getattr(module, "SimpleInputPartition", None)
    if wrapper is None or partition is None:
        return False
    try:
        init = inspect.signature(wrapper.__init__).parameters
        part = inspect.signature(partition.__init__).parameters
    except (TypeError, ValueError):
        return False
    return (
        callable(getattr(wrapper, "add_result_to_cache", None))
        and list(init)[1:] == ["simple_reader"]
        and list(part)[1:3] == ["start", "end"]
    )


PREFETCH_SUPPORTED = _internal is not None and _usable(_internal)

if TYPE_CHECKING:
    from pyspark.sql.datasource_internal import SimpleInputPartition
    from pyspark.sql.datasource_internal import _SimpleStreamReaderWrapper as SimpleWrapper
elif PREFETCH_SUPPORTED:
    SimpleWrapper = _internal._SimpleStreamReaderWrapper
    SimpleInputPartition = _internal.SimpleInputPartition
else:  # pragma: no cover - exercised only on a PySpark that changed the private API
    SimpleWrapper = DataSourceStreamReader
    SimpleInputPartition = InputPartition

__all__ = ["PREFETCH_SUPPORTED", "SimpleInputPartition", "SimpleWrapper"]
