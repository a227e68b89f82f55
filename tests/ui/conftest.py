"""A real `fulcrum serve` on the bundled model and a headless Chromium, shared by the web page's tests (test_page.py
skips with the reason when chromium, chromedriver or selenium are missing)."""

from __future__ import annotations

import pytest

from tests.servers import start_server
from tests.ui.browser import start_browser, stop_browser


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
