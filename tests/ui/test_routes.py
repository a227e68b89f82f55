"""The page's routes without a browser: --no-ui leaves / out, the key gates the API and not the page, the autoscaler's
decisions are listed for the router's dashboard, and the offline page of `fulcrum bench view` holds its data."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from fulcrum.cli import build_parser
from fulcrum.router.app import Router, RouterConfig, build_app
from fulcrum.router.autoscaler import Autoscaler, Event, ScalerConfig
from fulcrum.router.pool import Pool
from fulcrum.utils.web_page import offline_page


def router_app(ui=True, api_key=None, autoscaler=False):
    pool = Pool([])
    router = Router(pool, RouterConfig(api_key=api_key))
    scaler = Autoscaler(pool, backend=None, cfg=ScalerConfig()) if autoscaler else None
    return TestClient(build_app(router, scaler, ui=ui)), scaler


def test_no_ui_leaves_the_page_out():
    client, _ = router_app(ui=False)
    assert client.get("/").status_code == 404 and client.get("/ui/app.js").status_code == 404
    for verb in ("serve", "router"):
        assert build_parser().parse_args([verb, "--no-ui"]).ui is False
        assert build_parser().parse_args([verb]).ui is True


def test_the_key_gates_the_api_and_not_the_page():
    client, _ = router_app(api_key="sesame")
    page = client.get("/")
    assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
    assert client.get("/ui/style.css").status_code == 200
    assert client.get("/ui/api.py").status_code == 401  # only the page's own files are open
    assert client.get("/v1/models").status_code == 401
    client, _ = router_app(ui=False, api_key="sesame")
    assert client.get("/").status_code == 401  # without the page, / is an API path as before


def test_the_autoscalers_decisions_are_listed():
    client, scaler = router_app(autoscaler=True)
    scaler.events.append(Event(1.0, "up", 2, "ttft p90 0.9 s over the SLO"))
    scaler.events.append(Event(2.0, "down", 1, "idle"))
    got = client.get("/autoscaler/decisions").json()["decisions"]
    assert [(d["from"], d["to"], d["reason"]) for d in got] == [(1, 2, "ttft p90 0.9 s over the SLO"), (2, 1, "idle")]
    assert router_app()[0].get("/autoscaler/decisions").json() == {"autoscaler": False, "decisions": []}


def test_the_offline_page_holds_the_results_and_runs_no_other_script():
    doc = {"runs": [{"label": "c=1", "summary": {"note": "</script><script>alert(1)</script>"}}]}
    html = offline_page([("a", doc)])
    assert "<script src" not in html and 'href="/ui/' not in html  # nothing to fetch
    data = html.split('<script type="application/json" id="bench-data">')[1].split("</script>")[0]
    assert json.loads(data) == [{"name": "a", "doc": doc}]  # the "</" inside cannot close the block early
    assert "script-src 'sha256-" in html and "'unsafe-inline'" not in html
