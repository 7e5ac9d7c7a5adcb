"""The node journal's frames: what goes in comes out, and a crash's torn tail is found."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from queue_engine.store.journal import Record, decode, encode

headers = st.none() | st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8))


@st.composite
def records(draw: st.DrawFn) -> Record:
    bodies = draw(st.lists(st.binary(max_size=300), min_size=1, max_size=20))
    return Record(
        position=draw(st.integers(0, 2**63 - 1)),
        topic=draw(st.text(st.sampled_from("abc._-#0123"), min_size=1, max_size=64)),
        published_at_us=draw(st.integers(0, 2**62)),
        deliver_at_us=draw(st.none() | st.integers(0, 2**62)),
        expires_at_us=draw(st.none() | st.integers(0, 2**62)),
        bodies=bodies,
        # A publish's messages have headers (one entry each, some None) or none has any.
        headers=draw(st.none() | st.lists(headers, min_size=len(bodies), max_size=len(bodies))),
    )


def test_a_frame_without_headers_is_the_frame_written_before_headers_existed() -> None:
    """Journals written before headers existed are read by this version, and a publish
    without headers is still written as they were."""
    old = bytes.fromhex(
        "0000003260ffb623000000000000000700000000000003e8ffffffffffffffffffffffffffffffff"
        "000100000002740000000200000001616263"
    )
    record = Record(7, "t", 1000, None, None, [b"ab", b"c"])
    assert encode(record) == old
    assert decode(old).records == [record]
    with_headers = Record(7, "t", 1000, None, None, [b"ab", b"c"], [{"k": "v"}, None])
    assert decode(encode(with_headers)).records == [with_headers]


@given(st.lists(records(), max_size=8))
def test_records_come_back_as_written(written: list[Record]) -> None:
    data = b"".join(map(encode, written))
    decoded = decode(data)
    assert decoded.records == written
    assert (decoded.valid_bytes, decoded.torn) == (len(data), None)


@given(st.lists(records(), min_size=1, max_size=5), st.data())
def test_a_torn_tail_keeps_every_whole_frame_before_it(
    written: list[Record], data: st.DataObject
) -> None:
    frames = [encode(r) for r in written]
    whole = b"".join(frames[:-1])
    cut = data.draw(st.integers(0, len(frames[-1]) - 1))
    decoded = decode(whole + frames[-1][:cut])
    assert decoded.records == written[:-1]
    assert decoded.valid_bytes == len(whole)
    # Only zeros where a frame would begin read as nothing written (the zeros a segment file
    # is filled with); the first bytes of a short frame's length are zeros too.
    assert (decoded.torn is None) == (not any(frames[-1][:cut]))


@given(st.lists(records(), min_size=1, max_size=5), st.data())
def test_a_corrupt_frame_is_found_and_what_came_before_is_kept(
    written: list[Record], data: st.DataObject
) -> None:
    frames = [encode(r) for r in written]
    broken = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[broken])
    at = data.draw(st.integers(8, len(frame) - 1))  # a payload byte: the checksum fails
    frame[at] ^= 0xFF
    raw = b"".join([*frames[:broken], bytes(frame), *frames[broken + 1 :]])
    decoded = decode(raw)
    assert decoded.records == written[:broken]
    assert decoded.torn is not None and "checksum" in decoded.torn


@given(st.lists(records(), min_size=1, max_size=5), st.integers(1, 4096), st.data())
def test_a_file_filled_with_zeros_ends_where_its_zeros_begin(
    written: list[Record], zeros: int, data: st.DataObject
) -> None:
    """A segment written into a file of zeros: the zeros after the last frame are its end, not
    a torn frame; a frame a crash cut short before those zeros is still reported."""
    frames = [encode(r) for r in written]
    whole = b"".join(frames)
    decoded = decode(whole + bytes(zeros))
    assert decoded.records == written
    assert (decoded.valid_bytes, decoded.torn) == (len(whole), None)

    head = b"".join(frames[:-1])
    cut = data.draw(st.integers(8, len(frames[-1]) - 1))  # past the header: length is known
    torn = decode(head + frames[-1][:cut] + bytes(zeros))
    rest = frames[-1][cut:]
    if any(rest) or len(rest) > zeros:
        assert torn.records == written[:-1] and torn.valid_bytes == len(head)
        assert torn.torn is not None
    else:  # only zeros were cut (an empty body's tail), and the zeros make the frame whole
        assert torn.records == written and torn.torn is None
