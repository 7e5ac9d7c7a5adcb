"""The docs say what the code does: every setting, endpoint and command is documented, and the
repository speaks of the product only."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from starlette.routing import Mount

from api.app import create_app
from api.fastpath import _ROUTES
from deltaq.cli import build_parser
from queue_engine.settings import Settings
from tests.conftest import ROOT, run_deltaq

DOCS = ROOT / "docs"


def test_every_setting_is_documented_in_operations() -> None:
    keys = set(tomllib.loads((ROOT / "conf" / "default.toml").read_text()))
    assert keys == set(Settings.model_fields), "conf/default.toml and Settings differ"
    table = (DOCS / "operations.md").read_text()
    missing = [key for key in sorted(keys) if f"| `{key}` |" not in table]
    assert not missing, f"settings missing from docs/operations.md: {missing}"


def test_every_endpoint_is_documented_in_http_api() -> None:
    app = create_app(Settings())
    paths = set(app.openapi()["paths"]) | {path for _, path in _ROUTES}
    assert {"/pub", "/sub", "/stats", "/channel/create"} <= paths
    # Nothing else is served but Swagger UI's and the console's assets.
    assert all(
        not isinstance(r, Mount) or r.path.startswith(("/_static", "/console/static"))
        for r in app.routes
    )
    # Markdown tables escape the | of "/topic/create|delete|...".
    text = (DOCS / "http-api.md").read_text().replace("\\|", "|")
    # /topic/create|delete|... are written as one row per family.
    families = {
        m.group(1) + "/" + v
        for m in re.finditer(r"`[A-Z]+ (/\w+)/([\w|]+)", text)
        for v in m.group(2).split("|")
    }
    mentioned = set(re.findall(r"`(?:GET |POST |PUT )?(/[\w/{}]*)", text)) | families
    missing = sorted(p for p in paths if p not in mentioned)
    assert not missing, f"endpoints missing from docs/http-api.md: {missing}"


def test_every_command_has_help_with_a_description() -> None:
    parser = build_parser()
    [commands] = [a for a in parser._actions if a.dest == "command"]
    names = sorted(commands.choices)  # type: ignore[arg-type]
    assert names == ["api", "fanout", "jobs", "redrive", "replay", "sql", "sweep", "token", "up"]
    readme = (ROOT / "README.md").read_text()
    for name in names:
        result = subprocess.run(
            [sys.executable, "-m", "deltaq", name, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        usage, _, rest = result.stdout.partition("\n\n")
        description = rest.split("\n\n")[0]
        assert usage.startswith(f"usage: deltaq {name}") and description.strip(), result.stdout
        assert "``" not in result.stdout, description
        # A tokens file / the API's address, no warehouse.
        if name not in ("token", "redrive", "replay"):
            assert "--warehouse" in result.stdout and "--config" in result.stdout
        if name != "jobs":  # deltaq up's child, not a user's command
            assert f"deltaq {name}" in readme


def test_deltaq_version_names_deltaq_and_its_engines() -> None:
    from importlib.metadata import version

    result = run_deltaq("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"deltaq {version('deltaq')} (pyspark {version('pyspark')}, "
        f"delta-spark {version('delta-spark')}, deltalake {version('deltalake')})"
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sweep", "--warehouse", "{tmp}/nothing-here"], "no deltaq warehouse at"),
        (["sql", "--warehouse", "{tmp}/nothing-here", "SELECT 1"], "no deltaq warehouse at"),
        (["api", "--config", "{tmp}/missing.toml"], "missing.toml"),
        # nsqd's own refusal, word for word, before anything starts.
        (
            ["api", "--warehouse", "{tmp}/w", "--tls-required"],
            "cannot require TLS client connections without TLS key and cert",
        ),
    ],
)
def test_command_errors_are_one_line(tmp_path: object, argv: list[str], expected: str) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    result = subprocess.run(
        [sys.executable, "-m", "deltaq", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert lines[0].startswith(f"deltaq {args[0]}: error: ")


def test_the_repository_speaks_of_the_product_only() -> None:
    # Spelled in pieces so that this file does not match itself.
    words = re.compile(
        r"\b("
        + "|".join(
            ["sess" + "ion [0-9]+", "iss" + "ue [0-9]+", "rev" + "iew mend", "same" + " hour"]
        )
        + r")",
        re.I,
    )
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = [
        f"{path}: {m.group(0)}"
        for path in tracked
        for m in words.finditer((ROOT / path).read_text(errors="replace"))
    ]
    assert not found, found


def test_every_error_code_is_listed_in_http_api_with_its_status() -> None:
    from api.responses import STATUS
    from queue_engine.errors import ErrorCode

    text = (ROOT / "docs" / "http-api.md").read_text().split("### Every error code", 1)[1]
    listed = {
        code: int(status)
        for code, status in re.findall(r"^\| `([A-Z_]+)` \| (\d{3}) \|", text, re.M)
    }
    assert listed == {str(code): status for code, status in STATUS.items()}
    assert set(STATUS) == set(ErrorCode), "an ErrorCode without an HTTP status"
