"""One warm-up builds every CPU kernel before the first request, and touches nothing on other devices."""

from pathlib import Path

import pytest
import torch

from fulcrum import kernels
from fulcrum.kernels import cpu_attention, cpu_ext, cpu_gemv, cpu_norm


@pytest.fixture
def built(monkeypatch):
    calls = []
    for module in (cpu_gemv, cpu_attention, cpu_norm):
        name = module.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(module, "available", lambda name=name: calls.append(name) or True)
    return calls


def test_warm_up_builds_every_cpu_kernel(built):
    kernels.warm_up("cpu")
    assert sorted(built) == ["cpu_attention", "cpu_gemv", "cpu_norm"]


def test_warm_up_builds_nothing_for_another_device(built):
    kernels.warm_up(torch.device("meta"))
    assert built == []


def test_the_build_keeps_its_cache_folder_and_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path))
    assert Path(cpu_ext._build_dir(cpu_ext.CSRC / "act.cpp", ["-O3"])).parent == tmp_path / "kernels"
    # FULCRUM_CPU_KERNELS=0: nothing is built, callers stay on PyTorch ops
    monkeypatch.setenv("FULCRUM_CPU_KERNELS", "0")
    assert cpu_ext.load("act.cpp", "avx2", {}) is None
