"""Empty files made ahead for local commits: a table keeps two ready, more once it commits
faster than they are made, and what it took is its own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from queue_engine.store.delta import SpareFiles


def _ready(spares: SpareFiles, count: int) -> list[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names = os.listdir(spares.directory)
        if len(names) == count:
            return names
        time.sleep(0.01)
    raise AssertionError(f"{os.listdir(spares.directory)} is not {count} files")


def test_a_table_keeps_two_then_more_once_it_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spares = SpareFiles(str(tmp_path / "t"))
    try:
        assert spares.stock == 2
        _ready(spares, 2)
        with monkeypatch.context() as m:
            m.setattr(spares, "_ask", lambda: None)  # no refill between these takes
            taken = [spares.take() for _ in range(3)]  # the third finds none ready
        assert len(set(taken)) == 3
        assert all(os.path.getsize(p) == 0 for p in taken)
        assert spares.stock == 4
        taken.append(spares.take())  # none ready again: eight now, and a refill is asked for
        assert spares.stock == 8
        assert len(_ready(spares, 8 + len(taken))) == 12  # eight ready beside the four taken
        for _ in range(9):
            spares.take()
        assert spares.stock == 8  # at most
    finally:
        spares.close()
