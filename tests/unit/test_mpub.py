from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.mpub import check_single, encode_binary, parse_binary, split_text


def code_of(fn, *args) -> ErrorCode:  # type: ignore[no-untyped-def]
    with pytest.raises(QueueError) as e:
        fn(*args)
    return e.value.code


@given(st.lists(st.binary(min_size=1, max_size=50), min_size=1, max_size=30))
def test_binary_roundtrip(messages: list[bytes]) -> None:
    assert parse_binary(encode_binary(messages), 50, 10_000) == messages


@given(st.lists(st.binary(max_size=20).filter(lambda b: b"\n" not in b), max_size=30))
def test_text_split_skips_empty(lines: list[bytes]) -> None:
    assert split_text(b"\n".join(lines), 20, 10_000) == [line for line in lines if line]


def test_single() -> None:
    assert check_single(b"x", 1) == b"x"
    assert code_of(check_single, b"", 1) is ErrorCode.MSG_EMPTY
    assert code_of(check_single, b"xx", 1) is ErrorCode.MSG_TOO_BIG


def test_text_limits() -> None:
    assert code_of(split_text, b"x" * 11, 100, 10) is ErrorCode.BODY_TOO_BIG
    assert code_of(split_text, b"ok\n" + b"y" * 6, 5, 100) is ErrorCode.MSG_TOO_BIG
    assert split_text(b"\n\n", 5, 100) == []


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"", ErrorCode.BAD_BODY),
        (b"\x00\x00\x01", ErrorCode.BAD_BODY),
        (struct.pack(">i", 0), ErrorCode.BAD_BODY),
        (struct.pack(">i", -3), ErrorCode.BAD_BODY),
        # (max_body - 4) // 5 = 19 messages at most for a 100-byte body limit.
        (struct.pack(">i", 20), ErrorCode.BAD_BODY),
        (struct.pack(">i", 1) + b"\x00", ErrorCode.BAD_MESSAGE),
        (struct.pack(">ii", 1, 0), ErrorCode.BAD_MESSAGE),
        (struct.pack(">ii", 1, 11) + b"x" * 11, ErrorCode.BAD_MESSAGE),
        (struct.pack(">ii", 1, 5) + b"abc", ErrorCode.BAD_MESSAGE),
        (b"x" * 101, ErrorCode.BODY_TOO_BIG),
    ],
)
def test_binary_errors(body: bytes, code: ErrorCode) -> None:
    assert code_of(parse_binary, body, 10, 100) is code


def test_binary_max_count_and_trailing_bytes() -> None:
    body = encode_binary([b"a"] * 19)
    assert len(parse_binary(body, 10, 100)) == 19
    assert parse_binary(encode_binary([b"a"]) + b"zz", 10, 100) == [b"a"]
