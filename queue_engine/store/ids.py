"""Message ids as an Arrow column, built without a Python object per message."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from queue_engine.message import MESSAGE_ID_HEX_LENGTH

_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_SHIFTS = np.arange(60, -4, -4, dtype=np.uint64)


def hex_id_array(first: int, count: int, step: int = 1) -> pa.StringArray:
    """``count`` ids ``step`` apart starting at ``first``, each as 16 lower-case hex chars."""
    values = np.arange(first, first + count * step, step, dtype=np.uint64)
    nibbles = (values[:, None] >> _SHIFTS) & np.uint64(0xF)
    chars = _HEX_DIGITS[nibbles].reshape(-1)
    offsets = np.arange(
        0, MESSAGE_ID_HEX_LENGTH * (count + 1), MESSAGE_ID_HEX_LENGTH, dtype=np.int32
    )
    array = pa.StringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(chars))
    assert isinstance(array, pa.StringArray)
    return array
