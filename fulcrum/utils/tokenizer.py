"""Tokenizer of a model folder (tokenizer.json + tokenizer_config.json, with its chat template)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fulcrum.errors import ModelLoadError


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ModelLoadError(f"no tokenizer.json or tokenizer_config.json in {path}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of `messages` rendered through the model's chat template (by default ready for the reply);
    `tools` (OpenAI's function definitions) go to the template as transformers passes them, `template_kwargs` as
    extra template variables (e.g. enable_thinking)."""
    if not messages:
        raise ValueError("messages must not be empty")
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
        **(template_kwargs or {}),
    )  # fmt: skip
    return list(ids)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    """Give a model folder (a test or benchmark model with random weights) another folder's tokenizer."""
    import shutil

    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, Path(dst) / name)
