"""The name clients use for the model when the server is not given --served-model-name."""

from pathlib import Path

from fulcrum.server.launch import default_model_name


def test_a_hub_id_is_served_under_the_id_not_its_snapshot_hash(tmp_path):
    snapshot = tmp_path / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "0123abcd"
    assert default_model_name("Qwen/Qwen2.5-0.5B", snapshot) == "Qwen/Qwen2.5-0.5B"
    assert default_model_name("Qwen/Qwen2.5-0.5B@v1.0", snapshot) == "Qwen/Qwen2.5-0.5B"


def test_a_folder_or_gguf_file_is_served_under_its_name(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert default_model_name(str(folder), folder) == "my-model"
    assert default_model_name(None, Path("/models/tiny-shakespeare-target")) == "tiny-shakespeare-target"
    gguf = tmp_path / "model-Q8_0.gguf"
    gguf.write_bytes(b"")
    assert default_model_name(str(gguf), tmp_path / "cache" / "model-Q8_0") == "model-Q8_0"
