"""Where `bench serve` gets exact token counts when no --tokenizer is given: the model's folder in the local Hugging
Face cache (the files a vLLM or fulcrum server started by that Hub ID loads itself; never downloaded), else the
server's own tokenizer over HTTP (`/tokenize` and `/detokenize`, which fulcrum and vLLM both serve). Without
either, prompts are approximate (common words, about one token each) and the run says so."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from fulcrum.bench.client import normalize_base_url
from fulcrum.errors import FulcrumError


class ServerTokenizer:
    """The server's tokenizer, as TextMaker uses one (encode, decode), a POST per call. Its vocabulary is not known
    here, so prompts are drawn from words and cut to length by the server's own tokens."""

    def __init__(self, base_url: str, model: str, headers: dict | None = None, timeout: float = 30.0):
        self.root, self.model, self.timeout = normalize_base_url(base_url), model, timeout
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        # no proxies from the environment, as the load generator's own client (aiohttp's default)
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.root + path, json.dumps(body).encode(), self.headers, method="POST")
        with self._open(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def encode(self, text: str, add_special_tokens: bool = False, **_) -> list[int]:
        out = self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens})
        return list(out["tokens"])

    def decode(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"])


@dataclass
class Found:
    tokenizer: object | None
    source: str  # said in the result's prompt_lengths
    why_not: list[str]  # what was tried and failed, for the warning when nothing was found


def _from_hub_cache(model: str):
    """The tokenizer of `model`'s snapshot in the local Hugging Face cache, or an exception saying why not."""
    from fulcrum.model_folder.source import resolve_model
    from fulcrum.utils.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model))


def _from_server(base_url: str, model: str, headers: dict) -> ServerTokenizer:
    tok = ServerTokenizer(base_url, model, headers)
    ids = tok.encode("To be, or not to be")
    if not ids or not all(isinstance(i, int) for i in ids) or not isinstance(tok.decode(ids), str):
        raise ValueError("/tokenize or /detokenize answered without token ids or text")
    return tok


def find_tokenizer(base_url: str, model: str, headers: dict) -> Found:
    why_not = []
    try:
        return Found(_from_hub_cache(model), f"exact (tokenizer of {model} in the Hugging Face cache)", [])
    except (FulcrumError, OSError, ValueError) as e:  # not a Hub ID, not cached, no tokenizer files: the next source
        why_not.append(f"the Hugging Face cache: {e}")
    try:
        return Found(_from_server(base_url, model, headers), "exact (the server's /tokenize)", [])
    except (OSError, ValueError, KeyError, TypeError) as e:  # HTTPError and URLError are OSErrors
        detail = f"{e.code} {e.reason}" if isinstance(e, urllib.error.HTTPError) else str(e)
        why_not.append(f"the server's /tokenize: {detail}")
    return Found(None, "approximate (words, no tokenizer)", why_not)
