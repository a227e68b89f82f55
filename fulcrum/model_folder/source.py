"""What a model setting names, as a folder of Hugging Face files: a local folder, a Hub ID found in the local
Hugging Face cache (never downloaded), or a llama.cpp `.gguf` file, which gets a folder of its own
(fulcrum.model_folder.from_gguf)."""

from __future__ import annotations

import os
from pathlib import Path

from fulcrum.errors import ModelLoadError, ModelNotCachedError
from fulcrum.model_folder.from_gguf import gguf_model_folder


def resolve_model(model: str | Path) -> Path:
    """The folder of Hugging Face files `model` stands for: the folder itself; a `.gguf` file's folder; or, for
    a Hub ID (`org/name`, optionally `@revision`) that is not a local path, its snapshot in the local cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _model_folder(path, str(path))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file, neither a model folder nor a .gguf file")
        return gguf_model_folder(path)
    if path.suffix == ".gguf":
        raise ModelLoadError(f"GGUF file {path} not found")
    if not _is_hub_id(str(model)):
        raise ModelLoadError(f"{model} is not a model folder: no such folder")
    return _model_folder(hub_snapshot(str(model)), f"{model} (Hugging Face cache snapshot {{folder}})")


def _model_folder(folder: Path, what: str) -> Path:
    """A folder with config.json, or one holding a single .gguf file and no config.json (how GGUF repos ship)."""
    if (folder / "config.json").exists():
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return gguf_model_folder(ggufs[0])
    what = what.format(folder=folder)
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ModelLoadError(f"{what} holds several GGUF files ({names}) and no config.json: give the file's path")
    raise ModelLoadError(f"{what} is not a model folder: config.json not found")


# -- the Hugging Face cache ------------------------------------------------------------------------------------


def hub_cache_dir() -> Path:
    """The Hub cache folder, from HF_HUB_CACHE / HF_HOME / XDG_CACHE_HOME as huggingface_hub.constants reads them,
    but read now: the library reads them once, at its import, so a variable set later (by a launcher, a test)
    would not count there."""
    home = os.path.join(os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "huggingface")
    home = os.path.expandvars(os.path.expanduser(os.getenv("HF_HOME", home)))
    cache = os.getenv("HF_HUB_CACHE", os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def _is_hub_id(model: str) -> bool:
    """Whether `model` can be a Hub ID (`org/name@revision`) rather than only a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model.partition("@")[0])
    except HFValidationError:
        return False
    return True


def hub_snapshot(model: str) -> Path:
    """The cached snapshot folder of a Hub ID (`org/name`, `org/name@branch-tag-or-commit`)."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download

    # huggingface_hub 2 checks a snapshot against its cached file listing; earlier versions raise no such error
    incomplete = getattr(hub_errors, "IncompleteSnapshotError", ())

    repo_id, _, revision = model.partition("@")
    cache = hub_cache_dir()
    try:
        # local_files_only always, not only under HF_HUB_OFFLINE: fulcrum never downloads at run time (a server
        # must not start a multi-GB transfer, and these machines have no network); `hf download` fetches first
        folder = snapshot_download(repo_id, revision=revision or None, cache_dir=cache, local_files_only=True)
    except incomplete as e:
        raise ModelNotCachedError(f"{model}: the Hugging Face cache at {cache} holds it only in part ({e})") from None
    except hub_errors.LocalEntryNotFoundError:
        rev = f" at revision {revision!r}" if revision else ""
        raise ModelNotCachedError(
            f"{model} is not a local folder, and the Hugging Face cache at {cache} has no snapshot of {repo_id}{rev} "
            f"(fulcrum never downloads: fetch it with `hf download {repo_id}`, or point HF_HUB_CACHE or HF_HOME "
            f"at the cache that holds it)"
        ) from None
    return Path(folder)
