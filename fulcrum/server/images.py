"""Images in chat messages (`image_url` content parts): data URLs only, decoded here; the engine's ImagePrompts
expands them into the prompt (engine/multimodal.py). Every fault is a 400 naming the part."""

from __future__ import annotations

import base64
import binascii

from fulcrum.errors import InvalidRequestError
from fulcrum.protocol import ChatMessage


def data_url_bytes(url: str, field: str) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; any other URL is refused (fulcrum downloads nothing)."""
    if url.startswith(("http://", "https://")):
        raise InvalidRequestError(
            f"{field}: image downloads are off; send the image inline as a data URL (data:image/png;base64,...)",
            field,
        )
    head, sep, payload = url.partition(",")
    if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
        raise InvalidRequestError(f"{field}: an image must be a data URL (data:image/<type>;base64,<data>)", field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{field}: the data URL's base64 does not decode", field) from None


def message_images(messages: list[ChatMessage]) -> tuple[list[bytes], list[str]]:
    """Every image of a conversation in order: its bytes and the field that sent it."""
    raw, fields = [], []
    for i, m in enumerate(messages):
        for j, url in m.image_urls():
            field = f"messages[{i}].content[{j}].image_url"
            raw.append(data_url_bytes(url, field))
            fields.append(field)
    return raw, fields
