from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from queue_engine.settings import AckMode, Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]


def test_conf_default_toml_says_what_the_defaults_are(monkeypatch: pytest.MonkeyPatch) -> None:
    # DELTAQ_* variables would apply to both sides and hide a difference.
    for name in [n for n in os.environ if n.startswith("DELTAQ_")]:
        monkeypatch.delenv(name)
    assert load_settings(str(ROOT / "conf" / "default.toml")) == Settings()
    # And every setting is in the file: one it leaves out would take the same default on
    # both sides above, and the file would no longer list them all.
    listed = tomllib.loads((ROOT / "conf" / "default.toml").read_text())
    assert set(listed) == set(Settings.model_fields)


def test_nsqd_defaults() -> None:
    s = Settings()
    assert (s.msg_timeout_ms, s.max_msg_timeout_ms) == (60_000, 900_000)
    # Not nsqd's hour: deferred messages are durable rows, so a week is allowed.
    assert s.max_req_timeout_ms == 7 * 24 * 3_600_000
    assert (s.max_msg_size_bytes, s.max_body_size_bytes, s.max_rdy_count) == (
        1 << 20,
        5 << 20,
        2500,
    )
    assert s.ack is AckMode.JOURNAL


def test_precedence_flag_over_env_over_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('port = 1111\nwarehouse = "from-file"\nack = "buffer"\n')
    s = load_settings(str(conf))
    assert (s.port, s.warehouse, s.ack) == (1111, "from-file", AckMode.BUFFER)
    monkeypatch.setenv("DELTAQ_PORT", "2222")
    assert load_settings(str(conf)).port == 2222
    assert load_settings(str(conf), port=3333, warehouse=None).port == 3333
    assert load_settings(str(conf), warehouse=None).warehouse == "from-file"


def test_unknown_keys_are_rejected(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text("no_such_setting = 1\n")
    with pytest.raises(ValueError):
        load_settings(str(conf))


def test_topics_on_an_object_store_commit_less_often() -> None:
    from queue_engine.topics import drain_linger_s

    assert drain_linger_s(Settings(), "/var/lib/deltaq") == 0.05
    assert drain_linger_s(Settings(), "s3://bucket/wh") == 0.2
    tuned = Settings(drain_linger_ms=10, object_store_drain_linger_ms=1000)
    assert (drain_linger_s(tuned, "wh"), drain_linger_s(tuned, "gs://b/wh")) == (0.01, 1.0)


def test_a_topic_nobody_waits_for_commits_less_often_never_more() -> None:
    from queue_engine.topics import drain_unwatched_linger_s

    assert drain_unwatched_linger_s(Settings(), "/var/lib/deltaq") == 0.25
    assert drain_unwatched_linger_s(Settings(), "s3://bucket/wh") == 0.25
    # Never shorter than a watched topic's.
    slow = Settings(drain_linger_ms=10_000, object_store_drain_linger_ms=500)
    assert drain_unwatched_linger_s(slow, "wh") == 10.0
    assert drain_unwatched_linger_s(slow, "s3://bucket/wh") == 0.5
    assert drain_unwatched_linger_s(Settings(drain_unwatched_linger_ms=0), "wh") == 0.05
