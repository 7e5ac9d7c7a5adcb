from __future__ import annotations

import pytest

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.names import (
    is_ephemeral,
    is_valid_name,
    path_segment,
    require_channel,
    require_topic,
)


@pytest.mark.parametrize(
    "name", ["a", "A.b-c_d", "x" * 64, "t#ephemeral", "x" * 54 + "#ephemeral", ".a", "a.."]
)
def test_valid(name: str) -> None:
    assert is_valid_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "x" * 65,
        "x" * 55 + "#ephemeral",
        "a b",
        "a/b",
        "a#b",
        "#ephemeral",
        ".",
        "..",
        "...#ephemeral",
        "é",
    ],
)
def test_invalid(name: str) -> None:
    assert not is_valid_name(name)


def test_require_codes() -> None:
    with pytest.raises(QueueError) as e:
        require_topic(None)
    assert e.value.code is ErrorCode.MISSING_ARG_TOPIC
    with pytest.raises(QueueError) as e:
        require_topic("bad name")
    assert e.value.code is ErrorCode.INVALID_TOPIC
    with pytest.raises(QueueError) as e:
        require_channel(None)
    assert e.value.code is ErrorCode.MISSING_ARG_CHANNEL
    with pytest.raises(QueueError) as e:
        require_channel("")
    assert e.value.code is ErrorCode.INVALID_CHANNEL
    assert require_topic("ok") == "ok"


def test_ephemeral_and_paths() -> None:
    assert is_ephemeral("x#ephemeral") and not is_ephemeral("x")
    assert path_segment("x#ephemeral") == "x@ephemeral"
    assert path_segment("plain") == "plain"
