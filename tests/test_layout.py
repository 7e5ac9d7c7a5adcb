"""The layout holds as docs/design.md's Layout section draws it: deltalake only in the store's
Delta I/O packages, the product reaching the store through its packages' names, and each of
the store's packages building only on those below it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

PRODUCT = ("queue_engine", "api", "jobs", "deltaq")
STORE = ROOT / "queue_engine" / "store"
# What each of the store's packages may import of the others.
MAY_IMPORT = {
    "storage": set(),
    "delta": {"storage"},
    "tables": {"storage", "delta", "journal"},
    "journal": {"storage"},
    "coordination": {"storage"},
    "upkeep": {"storage", "delta", "tables"},
}
DELTA_IO = {"delta", "tables", "upkeep"}


def _modules(path: Path) -> Iterator[tuple[str, int]]:
    """Every module ``path`` imports (its own statements, any depth), with the line."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def _product_files() -> list[Path]:
    files = [p for top in PRODUCT for p in (ROOT / top).rglob("*.py")]
    assert len(files) > 100, "the product's files were not found"
    return files


def _store_package(path: Path) -> str | None:
    parts = path.relative_to(ROOT).parts
    if parts[:2] == ("queue_engine", "store") and len(parts) > 3:
        return parts[2]
    return None


def test_only_the_stores_delta_io_packages_import_deltalake() -> None:
    wrong = sorted(
        f"{path.relative_to(ROOT)}:{line}"
        for path in _product_files()
        for module, line in _modules(path)
        if module.split(".")[0] == "deltalake" and _store_package(path) not in DELTA_IO
    )
    assert wrong == []


def test_the_product_reaches_the_store_through_its_packages() -> None:
    """Outside the store, ``queue_engine.store.tables`` and its peers, never their files."""
    packages = set(MAY_IMPORT)
    wrong = sorted(
        f"{path.relative_to(ROOT)}:{line} {module}"
        for path in _product_files()
        if _store_package(path) is None
        for module, line in _modules(path)
        if module.startswith("queue_engine.store.")
        and len(module.split(".")) > 3
        and module.split(".")[2] in packages
        and (STORE / module.split(".")[2] / f"{module.split('.')[3]}.py").exists()
    )
    assert wrong == []


def test_each_store_package_builds_only_on_those_below_it() -> None:
    seen = set()
    wrong = []
    for path in STORE.rglob("*.py"):
        package = _store_package(path)
        if package is None:
            continue
        seen.add(package)
        for module, line in _modules(path):
            parts = module.split(".")
            if parts[:2] != ["queue_engine", "store"] or len(parts) < 3:
                continue
            other = parts[2]
            if other != package and other not in MAY_IMPORT[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert seen == set(MAY_IMPORT), "a package of the store is missing from MAY_IMPORT"
    assert wrong == []


def test_no_name_a_store_package_offers_is_also_one_of_its_files() -> None:
    """``from queue_engine.store.tables import x`` must mean one thing: importing a file named
    ``x`` replaces a function ``x`` the package's __init__ offered."""
    clashes = []
    for init in STORE.glob("*/__init__.py"):
        files = {p.stem for p in init.parent.glob("*.py")}
        offered = {
            alias.asname or alias.name
            for node in ast.parse(init.read_text()).body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        clashes += sorted(f"{init.parent.name}.{name}" for name in offered & files)
    assert clashes == []


def fresh_interpreter(probe: str) -> str:
    """What ``probe`` prints, run by a new interpreter from the project's root (a failing probe
    fails the test with its errors)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_commands_start_loads_no_pyarrow() -> None:
    """Every deltaq command imports this before the serving process leaves pandas and numpy
    out of what pyarrow loads (queue_engine.process_memory): pyarrow must not come first."""
    out = fresh_interpreter(
        "import sys, deltaq.cli, jobs.command\n"
        "print(sorted(m for m in ('pyarrow', 'pandas', 'numpy', 'deltalake') if m in sys.modules))"
    )
    assert out.strip() == "[]", out


def test_the_serving_process_loads_sqlglot_only_for_a_schema_or_a_filter() -> None:
    """sqlglot (~12 MiB resident) parses typed topics' schemas and channel filters only: an API
    process whose warehouse has neither never imports it (queue_engine.filter_sql,
    queue_engine.schema_ddl)."""
    out = fresh_interpreter(
        "import sys, api.app, api.server, queue_engine.broker, queue_engine.fanout\n"
        "from queue_engine.channel_filter import compile_filter\n"
        "from queue_engine.topic_schema import parse_schema\n"
        "print('sqlglot' in sys.modules)\n"
        "parse_schema('sku STRING')\n"
        "print('sqlglot' in sys.modules)\n"
        "compile_filter('id = \\'a\\'')\n"
        "print('queue_engine.filter_sql' in sys.modules)\n"
    )
    assert out.split() == ["False", "True", "True"], out


def test_spark_python_workers_load_the_data_source_without_pandas() -> None:
    """Spark starts a Python process to create, plan and read each format("deltaq") query;
    importing the data source must not import pyarrow.dataset, which imports pandas (~0.3 s
    of each such process, measured)."""
    out = fresh_interpreter(
        "import sys, queue_engine.spark.source\n"
        "print(sorted(m for m in ('pandas', 'pyarrow.dataset') if m in sys.modules))"
    )
    assert out.strip() == "[]", out
