"""A real `fulcrum serve` on the bundled model and a headless Chromium, shared by the web page's tests; skipped with
the reason when chromium, chromedriver or selenium are missing."""

from __future__ import annotations

import pytest

from tests.servers import start_server
from tests.ui.browser import missing, start_browser, stop_browser

WHY = missing()


def pytest_collection_modifyitems(items):
    if WHY:
        for item in items:
            if "tests/ui/" in str(item.fspath) and "browser" in item.fixturenames:
                item.add_marker(pytest.mark.skip(reason=f"no headless browser: {WHY}"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("srv"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    d = start_browser()
    yield d
    stop_browser(d)
