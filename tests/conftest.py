import os

import pytest
import torch

from tests.tiny_models import save_tiny_model

# FULCRUM_NUM_THREADS=1 keeps tests from fighting a concurrent job (oversubscribed OpenMP threads spin)
torch.set_num_threads(int(os.environ.get("FULCRUM_NUM_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """One tiny model per family, built once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = save_tiny_model(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get
