"""Message ids as an Arrow column, built without a Python object per message."""

from __future__ import annotations

import array
import sys

import pyarrow as pa

from queue_engine.message import MESSAGE_ID_HEX_LENGTH


def hex_id_array(first: int, count: int, step: int = 1) -> pa.StringArray:
    """``count`` ids ``step`` apart starting at ``first``, each as 16 lower-case hex chars."""
    # Big-endian 64-bit integers, hex-encoded in one call, are the ids back to back. (No
    # numpy: the API process runs without it, queue_engine/process_memory.py.)
    values = array.array("Q", range(first, first + count * step, step))
    if sys.byteorder == "little":
        values.byteswap()
    chars = values.tobytes().hex().encode()
    offsets = array.array("i", range(0, MESSAGE_ID_HEX_LENGTH * (count + 1), MESSAGE_ID_HEX_LENGTH))
    built = pa.StringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(chars))
    assert isinstance(built, pa.StringArray)
    return built
