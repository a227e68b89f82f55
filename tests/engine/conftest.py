import pytest
import torch

from tests.tiny_models import save_tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """One tiny model per family, built once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = save_tiny_model(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get
