"""Reading transformers configs the same way everywhere."""

from __future__ import annotations

from typing import Any


def text_config(cfg: Any) -> Any:
    """The text model's config: multimodal and some hybrid configs nest it
    (``get_text_config()``); a plain config is its own."""
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
