"""The Java check before Spark starts: real executables on a JAVA_HOME of the test's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from queue_engine.spark.java import JavaUnavailableError, check_java, major_version
from queue_engine.store.delta import open_or_create
from queue_engine.store.tables import REGISTRY_SCHEMA, Warehouse
from tests.conftest import ROOT


def _java_home(tmp_path: Path, version: str) -> Path:
    """A JAVA_HOME whose bin/java answers ``-version`` as a JDK of ``version`` does."""
    home = tmp_path / f"jdk-{version}"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2024-01-16' >&2\n")
    java.chmod(0o755)
    return home


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_402"', 8),
        ("no version here", None),
    ],
)
def test_the_major_version_is_read_as_java_prints_it(output: str, major: int | None) -> None:
    assert major_version(output) == major


def test_a_java_17_passes_and_an_older_or_missing_one_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAVA_HOME", str(_java_home(tmp_path, "17.0.2")))
    check_java()
    monkeypatch.setenv("JAVA_HOME", str(_java_home(tmp_path, "1.8.0_402")))
    with pytest.raises(JavaUnavailableError, match=r"Java 17 or later.*is Java 8: install Java"):
        check_java()
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(JavaUnavailableError, match=r"found no java \(JAVA_HOME=.*nowhere\)"):
        check_java()


def test_a_spark_command_without_java_prints_one_line_and_exits_4(tmp_path: Path) -> None:
    warehouse = Warehouse(str(tmp_path / "w"))
    open_or_create(warehouse.registry_path, REGISTRY_SCHEMA)
    env = {**os.environ, "JAVA_HOME": str(_java_home(tmp_path, "11.0.2"))}
    # Spark's writer for the channel rows: this fanout needs Spark (a local one writing from
    # its own process does not start it).
    done = subprocess.run(
        [
            *(sys.executable, "-m", "deltaq", "fanout", "--once", "--warehouse", warehouse.root),
            *("--channel-writes", "deltaq"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 4, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "is Java 11" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_jdks_release_file_is_read_before_any_jvm_is_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JDK's ``release`` file decides: its java (here one that says 17) is not run."""
    home = _java_home(tmp_path, "17.0.2")
    (home / "release").write_text('IMPLEMENTOR="Test"\nJAVA_VERSION="11.0.22"\n')
    monkeypatch.setenv("JAVA_HOME", str(home))
    with pytest.raises(JavaUnavailableError, match=r"is Java 11"):
        check_java()
