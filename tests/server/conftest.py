"""Start real `fulcrum serve` processes on free loopback ports, and stop them."""

from __future__ import annotations

import pytest

from tests.servers import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("srv"))
    yield s
    s.stop()


@pytest.fixture
def fresh_server(tmp_path):
    """A server of the test's own, for tests that break or stop it; pass extra flags via the factory."""
    started = []

    def make(*args):
        s = start_server(tmp_path, *args)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
