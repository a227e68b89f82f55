"""The wheel works on its own: `python -m build` makes a wheel and an sdist; the wheel, installed into a fresh virtualenv
outside the source tree (its dependencies taken from this environment's site-packages, so nothing is downloaded),
holds the bundled models and kernel sources, and its `fulcrum serve` answers a request on the default model."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest

from fulcrum.utils.serve_process import free_port, start_command

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--sdist", "--outdir", str(out),
                    str(REPO)], check=True, capture_output=True, cwd=out)  # fmt: skip
    return out


def test_the_wheel_holds_the_models_and_kernel_sources(dist):
    (wheel,) = dist.glob("fulcrum-*.whl")
    assert list(dist.glob("fulcrum-*.tar.gz"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for model in ("tiny-shakespeare-target", "tiny-shakespeare-draft"):
        for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
            assert f"fulcrum/bundled/{model}/{f}" in names
    assert "fulcrum/kernels/csrc/decode_stack.cpp" in names and "fulcrum/kernels/csrc/exports.h" in names
    assert any(n.startswith("fulcrum/plan/") and n.endswith(".json") for n in names)
    for f in ("index.html", "app.js", "style.css"):  # the web page at /
        assert f"fulcrum/server/ui/{f}" in names


def test_the_installed_wheel_serves_outside_the_source_tree(dist, tmp_path):
    (wheel,) = dist.glob("fulcrum-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    alone = {**os.environ, "PYTHONPATH": ""}  # and out of the source tree (python -m puts the cwd on the path)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, cwd=tmp_path,
                   env=alone)  # fmt: skip
    # then the dependencies: this environment's packages as a plain path, after the install (pip would take the
    # editable fulcrum there for this one); its .pth files, the editable fulcrum's among them, are not read from there
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run([py, "-c", "import fulcrum; print(fulcrum.__file__)"], check=True, capture_output=True,
                           text=True, cwd=tmp_path, env=alone).stdout  # fmt: skip
    assert where.startswith(site), where  # the wheel's copy, not the source tree's
    port = free_port()
    cmd = [str(venv / "bin" / "fulcrum"), "serve", "--port", str(port), "--kv-cache-memory", "0.05"]
    # no PYTHONPATH: the source tree must not be what answers
    with start_command(cmd, port, log_path=tmp_path / "serve.log", timeout=120, env={"PYTHONPATH": ""}) as server:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert models[0]["id"] == "tiny-shakespeare-target" and models[0]["root"].startswith(site)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
