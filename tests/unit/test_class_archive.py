"""The class archive's bookkeeping, without a JVM: which options a session gets, a damaged
archive dropped and not rebuilt at once, one build at a time, and never an exception (the
archive only saves time). tests/spark/test_class_archive.py runs the JVMs."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from queue_engine.spark import class_archive


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(class_archive.ENV, raising=False)
    path = class_archive.archive_path()
    if path is None:
        pytest.skip("no java to key the archive by")
    path.parent.mkdir(parents=True)
    return path


def test_a_session_maps_the_archive_with_a_crash_report_of_its_own(cache: Path) -> None:
    cache.write_bytes(b"an archive")
    first, second = class_archive.java_options(), class_archive.java_options()
    assert f"-XX:SharedArchiveFile={cache}" in first.split()
    reports = [o for o in (first + " " + second).split() if o.startswith("-XX:ErrorFile=")]
    assert len(set(reports)) == 2 and all(str(cache.parent) in r for r in reports)
    assert not class_archive.crashed(first)
    # The JVM names its report after its pid (%p): this start's nonce finds it.
    report = reports[0].removeprefix("-XX:ErrorFile=").replace("%p", "4242")
    Path(report).write_text("crash")
    assert class_archive.crashed(first) and not class_archive.crashed(second)


def test_a_damaged_archive_is_dropped_and_not_rebuilt_at_once(cache: Path) -> None:
    cache.write_bytes(b"torn")
    options = f"-XX:TieredStopAtLevel=1 {class_archive.java_options()}"
    assert class_archive.drop(options) == "-XX:TieredStopAtLevel=1"
    assert not cache.exists()
    # No build is started while the failure is recent: no build log, no lock taken.
    assert class_archive.java_options() == ""
    assert not cache.with_suffix(".log").exists()
    assert not cache.with_suffix(".building").exists()


def test_no_second_build_starts_while_one_holds_the_lock(cache: Path) -> None:
    fd = os.open(cache.with_suffix(".building"), os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert class_archive.java_options() == ""
        assert not cache.with_suffix(".log").exists()  # nothing was started
        assert class_archive.build(cache) is False  # a builder started anyway gives way
        assert not cache.with_suffix(".failed").exists()
    finally:
        os.close(fd)


def test_off_or_unusable_means_no_options_and_no_error(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache.write_bytes(b"an archive")
    monkeypatch.setenv(class_archive.ENV, "0")
    assert class_archive.java_options() == ""
    monkeypatch.delenv(class_archive.ENV)
    # Spark splits a JVM's options on whitespace: a cache path with a space is not used.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "my cache"))
    assert class_archive.archive_path() is None
    assert class_archive.java_options() == ""
    # A cache that cannot be written: no archive, no build, no exception.
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert class_archive.java_options() == ""


def test_a_reinstalled_pyspark_gets_an_archive_of_its_own(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same jars written again (same names and sizes, new times, as a reinstall leaves
    them): the JVM would not map the archive dumped against the old ones, so the key moves."""
    import pyspark

    jars = tmp_path / "pyspark" / "jars"
    jars.mkdir(parents=True)
    jar = jars / "spark-core.jar"
    jar.write_bytes(b"x" * 100)
    monkeypatch.setattr(pyspark, "__file__", str(jars.parent / "__init__.py"))
    before = class_archive.archive_path()
    assert before is not None and before == class_archive.archive_path()
    stat = jar.stat()
    os.utime(jar, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = class_archive.archive_path()
    assert after is not None and after != before and after.parent == before.parent
