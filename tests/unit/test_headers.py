"""Envelopes and headers: exactly the headers within their limits are taken, as given."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.headers import (
    MAX_HEADERS,
    MAX_NAME_BYTES,
    MAX_VALUE_BYTES,
    check_headers,
    parse_envelope,
    parse_envelope_lines,
)

# Names and values around the limits (multi-byte characters count as their UTF-8 bytes).
_text = st.text(st.sampled_from("aé€"), max_size=MAX_VALUE_BYTES // 2 + 40)
_value = st.one_of(_text, st.integers(), st.none(), st.booleans())
_random_headers = st.dictionaries(
    st.text(st.sampled_from("k€"), max_size=MAX_NAME_BYTES // 3 + 10),
    _value,
    max_size=MAX_HEADERS + 3,
)


def _of_bytes(n: int) -> str:
    """A text of exactly ``n`` UTF-8 bytes, most of them in 3-byte characters (a count of
    characters instead of bytes would take it far past the limit)."""
    return "€" * (n // 3) + "a" * (n % 3)


# And each limit exactly, from just under it to just over it: random dictionaries almost
# never reach them.
_at_the_limits = st.one_of(
    st.integers(MAX_HEADERS - 1, MAX_HEADERS + 1).map(lambda n: {f"h{i}": "v" for i in range(n)}),
    st.integers(MAX_NAME_BYTES - 2, MAX_NAME_BYTES + 2).map(lambda n: {_of_bytes(n): "v"}),
    st.integers(MAX_VALUE_BYTES - 2, MAX_VALUE_BYTES + 2).map(lambda n: {"k": _of_bytes(n)}),
)
_headers = st.one_of(_random_headers, _at_the_limits)


def _fits(headers: dict[str, Any]) -> bool:
    return len(headers) <= MAX_HEADERS and all(
        name
        and len(name.encode()) <= MAX_NAME_BYTES
        and isinstance(value, str)
        and len(value.encode()) <= MAX_VALUE_BYTES
        for name, value in headers.items()
    )


@given(_headers)
@example({f"h{i}": "v" for i in range(MAX_HEADERS)})
@example({f"h{i}": "v" for i in range(MAX_HEADERS + 1)})
@example({_of_bytes(MAX_NAME_BYTES): "v"})
@example({_of_bytes(MAX_NAME_BYTES + 1): "v"})
@example({"k": _of_bytes(MAX_VALUE_BYTES)})
@example({"k": _of_bytes(MAX_VALUE_BYTES + 1)})
def test_headers_are_taken_exactly_when_they_fit_the_limits(headers: dict[str, Any]) -> None:
    data = json.dumps({"body": "b", "headers": headers}).encode()
    if _fits(headers):
        assert parse_envelope(data) == (b"b", headers or None)
    else:
        with pytest.raises(QueueError) as refused:
            parse_envelope(data)
        assert refused.value.code is ErrorCode.INVALID_HEADERS


@given(st.binary(max_size=64), st.text(max_size=64))
def test_bodies_come_out_as_given(raw: bytes, text: str) -> None:
    encoded = base64.b64encode(raw).decode()
    assert parse_envelope(json.dumps({"body_base64": encoded}).encode()) == (raw, None)
    assert parse_envelope(json.dumps({"body": text}).encode()) == (text.encode(), None)


def test_a_json_body_is_the_message_as_compact_json() -> None:
    data = b'{"body": {"sku": "A-1", "qty": [1, 2]}, "headers": {"k": "v"}}'
    assert parse_envelope(data) == (b'{"sku":"A-1","qty":[1,2]}', {"k": "v"})


def test_lines_keep_their_order_skip_blank_ones_and_name_a_bad_one() -> None:
    data = b'{"body": "a"}\n\n{"body": "b", "headers": {"x": "1"}}\n'
    assert parse_envelope_lines(data) == ([b"a", b"b"], [None, {"x": "1"}])
    with pytest.raises(QueueError, match="line 3: not JSON"):
        parse_envelope_lines(b'{"body": "a"}\n\n{"body": ')


def test_no_headers_and_empty_headers_are_the_same() -> None:
    assert check_headers(None) is None
    assert check_headers({}) is None
    with pytest.raises(QueueError, match="headers must be a JSON object"):
        check_headers(["k", "v"])
