"""The web console in a real headless browser (Debian's chromium driven by playwright),
against a real API with the fanout running: figures change after publishing, pause acts,
a message's ledger history and a peek show; screenshots go to the test's tmp dir."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server, unavailable
from tests.consumers import answer, create_channel, sub

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout_loop: None) -> Iterator[Server]:
    s = Server(warehouse).start()
    yield s
    s.stop()


@pytest.fixture
def page(server: Server) -> Iterator[Any]:
    if CHROMIUM is None:
        unavailable("no chromium on this machine (Debian: apt-get install chromium)")
    try:
        from playwright import sync_api
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[test]')")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("dialog", lambda dialog: dialog.accept())
        yield page
        browser.close()


def _cell(page: Any, topic: str, channel: str, css: str) -> str:
    text: str = page.locator(
        f'tr[data-topic="{topic}"][data-channel="{channel}"] td.{css}'
    ).inner_text()
    return text


def test_console_shows_and_acts(
    page: Any, server: Server, http: httpx.Client, tmp_path: Path
) -> None:
    create_channel(http, "web", "c")
    page.goto(f"{server.url}/console")
    row = page.locator('tr[data-topic="web"][data-channel="c"]')
    row.wait_for(timeout=15_000)
    assert _cell(page, "web", "c", "depth") == "0"
    assert _cell(page, "web", "c", "dead") == "0"
    # An empty channel is not behind: no version numbers of tables that have no rows yet.
    assert _cell(page, "web", "c", "delta") == "fanout caught up"
    page.screenshot(path=str(tmp_path / "console-empty.png"))

    for i in range(6):
        assert http.post("/pub", params={"topic": "web"}, content=f"hello {i}".encode()).is_success
    # The page refreshes itself: the fanned-out messages appear as the channel's depth.
    deadline = time.monotonic() + 60
    while _cell(page, "web", "c", "depth") != "6" and time.monotonic() < deadline:
        page.wait_for_timeout(300)
    assert _cell(page, "web", "c", "depth") == "6"

    leased = sub(http, "web", "c", max=2, wait_ms=5000)
    assert len(leased) == 2
    assert answer(http, "fin", "web", "c", leased[0]).is_success
    page.wait_for_function(
        "() => document.querySelector('tr[data-channel=\"c\"] td.in-flight').textContent === '1'",
        timeout=15_000,
    )

    # Select the channel: the chart, a peek at the next ready messages, a message's history.
    row.locator("a.select").click()
    page.locator("#chart .uplot").wait_for(timeout=15_000)
    page.locator("#peek-refresh").click()
    page.locator("#peek tbody tr").first.wait_for(timeout=15_000)
    peeked = page.locator("#peek tbody tr td:nth-child(3)").all_inner_texts()
    assert peeked == [f"hello {i}" for i in range(2, 6)]
    page.fill("#lookup-id", leased[0]["id"])
    page.locator("#lookup-form button").click()
    page.locator("#history td.event").first.wait_for(timeout=15_000)
    assert page.locator("#history td.event").all_inner_texts() == ["DELIVER", "FIN"]
    assert re.search(r"hello [01]", page.locator("#lookup p").inner_text())
    page.screenshot(path=str(tmp_path / "console-channel.png"), full_page=True)

    # Pause through the page (its confirmation is accepted): the API says paused.
    row.locator('button[data-action="pause"]').click()
    deadline = time.monotonic() + 15
    paused = False
    while not paused and time.monotonic() < deadline:
        stats = http.get("/stats", params={"format": "json", "topic": "web"}).json()
        paused = stats["topics"][0]["channels"][0]["paused"]
        time.sleep(0.2)
    assert paused
    page.wait_for_selector('tr.paused[data-channel="c"]', timeout=15_000)
    page.screenshot(path=str(tmp_path / "console-paused.png"), full_page=True)
    assert (tmp_path / "console-paused.png").stat().st_size > 10_000


def test_console_needs_no_network(http: httpx.Client) -> None:
    html = http.get("/console")
    assert html.status_code == 200
    assets = re.findall(r'(?:src|href)="([^"]+)"', html.text)
    assert assets and all(a.startswith("/console/static/") for a in assets)
    for asset in assets:
        assert http.get(asset).status_code == 200, asset


def test_the_api_docs_render_every_operation(page: Any, server: Server, tmp_path: Path) -> None:
    """/docs in a browser: Swagger UI renders the OpenAPI 3.1 document FastAPI writes, from
    assets the API serves itself."""
    page.goto(f"{server.url}/docs")
    page.locator(".opblock").first.wait_for(timeout=30_000)
    paths = page.locator(".opblock-summary-path").all_inner_texts()
    page.screenshot(path=str(tmp_path / "docs.png"), full_page=True)
    operations = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"]
    count = sum(
        1 for ops in operations.values() for m in ops if m in ("get", "post", "put", "delete")
    )
    assert {p.replace("\u200b", "") for p in paths} >= {"/pub", "/sub", "/fin", "/stats"}
    assert len(paths) == count
    assert "Unable to render" not in page.content()
