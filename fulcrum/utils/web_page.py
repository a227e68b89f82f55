"""The web page at `/` (chat playground, live dashboard, benchmark viewer): its static files in fulcrum/server/ui/,
served by `fulcrum serve` and `fulcrum router`, and inlined into one offline file by `fulcrum bench view`. The files
are package data read by path, so the router and bench (which never import the server) serve the same page."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from pathlib import Path

UI_DIR = Path(__file__).resolve().parent.parent / "server" / "ui"
SCRIPTS = ("prom.js", "charts.js", "chat.js", "dashboard.js", "bench.js", "app.js")  # in load order
MEDIA = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# the page runs its own files only, talks to its own origin only, and is framed by no one
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def is_page_path(path: str) -> bool:
    """What the page itself is: open without the API key (the page asks for the key and sends it to the API)."""
    return path == "/" or (path.startswith("/ui/") and path[4:] in asset_names())


@functools.cache
def asset_names() -> frozenset[str]:
    return frozenset(p.name for p in UI_DIR.iterdir() if p.suffix in MEDIA)


def shipped_bytes() -> int:
    """The page's weight: every file it loads."""
    return sum(p.stat().st_size for p in UI_DIR.iterdir() if p.suffix in MEDIA or p.name == "index.html")


def add_routes(app) -> None:
    """GET / and GET /ui/<file> on a FastAPI app (the caller's gate lets is_page_path through without a key)."""
    from fastapi.responses import HTMLResponse, Response

    index = (UI_DIR / "index.html").read_text()
    files = {name: (UI_DIR / name).read_bytes() for name in asset_names()}

    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(index, headers={**HEADERS, "Cache-Control": "no-cache"})

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in files:
            return Response(status_code=404)
        media = MEDIA[Path(name).suffix]
        return Response(files[name], media_type=media, headers={**HEADERS, "Cache-Control": "no-cache"})


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def offline_page(docs: list[tuple[str, dict]]) -> str:
    """One HTML file holding the page and the given `bench serve --out` results (name, document): it opens from
    disk with no server. The results sit in a JSON data block (never executed); the inlined script and style are
    allowed by their hashes, so the policy still runs nothing else."""
    script = "\n".join((UI_DIR / name).read_text() for name in SCRIPTS)
    style = (UI_DIR / "style.css").read_text()
    # "</" cannot end the data block early: JSON allows the escaped slash
    data = json.dumps([{"name": n, "doc": d} for n, d in docs]).replace("</", "<\\/")
    csp = f"default-src 'none'; script-src {_sha256(script)}; style-src {_sha256(style)}; img-src data:"
    html = (UI_DIR / "index.html").read_text()
    html = html.replace('<meta charset="utf-8">', f'<meta charset="utf-8">\n<meta http-equiv="Content-Security-Policy" '
                        f'content="{csp}">', 1)  # fmt: skip
    html = html.replace('<link rel="stylesheet" href="/ui/style.css">', f"<style>{style}</style>", 1)
    for name in SCRIPTS:
        html = html.replace(f'<script defer src="/ui/{name}"></script>\n', "", 1)
    return html.replace(
        "</body>",
        f'<script type="application/json" id="bench-data">{data}</script>\n<script>{script}</script>\n</body>',
        1,
    )
