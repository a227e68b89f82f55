"""What a model folder says about embeddings: whether it is an embedding model (sentence-transformers' modules.json,
or `--task embed`) and how it pools its hidden states into one vector (last token, mean or CLS, then normalised or
not). Read once at load; requests may choose another pooling and a shorter `dimensions` (matryoshka models)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

from fulcrum.errors import ModelLoadError

log = logging.getLogger(__name__)

TASKS = ("auto", "generate", "embed")
POOLING_TYPES = ("last", "mean", "cls")

# sentence-transformers' module types fulcrum runs itself: the transformer (fulcrum's model), its pooling and
# normalisation, named by class (modules.json gives "sentence_transformers.models.Pooling" before version 6, a longer
# path since); a Dense projection or any other module changes the vector and is refused by name
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
# sentence-transformers' pooling modes (1_Pooling/config.json: "pooling_mode" since version 6, a pooling_mode_* flag
# each before) -> fulcrum's pooling types
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding model makes its vector: `pooling_type` over the prompt's final hidden states, then L2
    normalisation when `normalize`. `matryoshka`: whether a request may ask for fewer `dimensions` (the leading
    ones, normalised again), and `dimensions_allowed` the sizes it names (empty: any up to the hidden size)."""

    pooling_type: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    dimensions_allowed: tuple[int, ...] = ()
    source: str = "default"  # where the settings came from, for the startup line


def resolve_task(
    path: Path, hf_config: PretrainedConfig, task: str = "auto", pooling_type: str | None = None
) -> tuple[str, PoolerConfig | None]:
    """("generate", None) or ("embed", its pooler). `auto`: an embedding model when the folder is a
    sentence-transformers model (modules.json with a Pooling module); otherwise a generative one."""
    if task not in TASKS:
        raise ModelLoadError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if pooling_type is not None and pooling_type not in POOLING_TYPES:
        raise ModelLoadError(f"pooling type {pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")
    st = _sentence_transformers(path)
    if task == "auto":
        task = "embed" if st is not None else "generate"
    if task == "generate":
        if pooling_type is not None:
            raise ModelLoadError("a pooling type applies to embedding models only (--task embed)")
        return task, None
    pooler = st or PoolerConfig()
    if pooling_type is not None and pooling_type != pooler.pooling_type:
        pooler = PoolerConfig(pooling_type, pooler.normalize, pooler.matryoshka, pooler.dimensions_allowed, "flag")
    dims = getattr(hf_config, "matryoshka_dimensions", None) or ()
    if dims or getattr(hf_config, "is_matryoshka", False):
        pooler = PoolerConfig(pooler.pooling_type, pooler.normalize, True, tuple(int(d) for d in dims), pooler.source)
    return task, pooler


def _sentence_transformers(path: Path) -> PoolerConfig | None:
    """The pooling a sentence-transformers folder states (modules.json, its Pooling module's config.json, a
    Normalize module), or None when the folder is not one."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{modules_file} cannot be read: {e}") from None
    mods = [m for m in modules if isinstance(m, dict)]
    types = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in mods]
    if _POOLING not in types:
        return None
    pooling = mods[types.index(_POOLING)]
    others = [str(m.get("type")) for m, t in zip(mods, types) if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if others:
        raise ModelLoadError(
            f"{modules_file} has sentence-transformers modules fulcrum does not run: {', '.join(others)} "
            "(it runs the transformer, its Pooling and Normalize)"
        )
    config_file = path / str(pooling.get("path", "")) / "config.json"
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"the Pooling module's {config_file} cannot be read: {e}") from None
    stated = cfg.get("pooling_mode")
    stated = [stated] if isinstance(stated, str) else list(stated or [])
    stated += [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    modes = [_ST_MODES.get(m) or _ST_FLAGS.get(m) for m in stated]
    if len(modes) != 1 or modes[0] is None:
        raise ModelLoadError(
            f"{config_file} asks for pooling {', '.join(map(str, stated)) or 'none'}; fulcrum pools with exactly "
            "one of the last token (lasttoken), the mean or the CLS token"
        )
    if cfg.get("include_prompt") is False:
        raise ModelLoadError(f"{config_file}: include_prompt false (pooling without the instruction) is not supported")
    return PoolerConfig(modes[0], _NORMALIZE in types, source="modules.json")
