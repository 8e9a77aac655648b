"""Prompt → token ids, the one rendering used by regeneration and evaluation.

The drafter is trained on what the target wrote after a prompt rendered one way; evaluating
it on prompts rendered another way (no system prompt, other template variables, other
special tokens) measures something else. Both ``regenerate.py`` and ``evaluate.py`` build a
``PromptRenderer`` from the same keys (``chat``, ``chat_template_kwargs``, ``system_prompt``)
and ``evaluate.py`` records them in its report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from dflash_lit.errors import UserError

CHAT_VALUES = ("auto", "true", "false")


class PromptLike(Protocol):
    """A prompt: plain ``text`` or chat ``messages`` (never both)."""

    text: str | None
    messages: list[dict[str, str]] | None


def resolve_chat(chat: Any, tokenizer: Any, where: str, key: str = "chat") -> bool:
    """``chat`` config value (auto|true|false) → whether to apply the chat template.

    ``where`` names the tokenizer for the error message, ``key`` the config key.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    value = "auto" if chat is None else str(chat).lower()
    if value == "auto":
        return has_template
    if value == "true":
        if not has_template:
            raise UserError(
                f"{key}=true but the tokenizer at {where} has no chat template (no chat_template "
                "in tokenizer_config.json, no chat_template.jinja); set chat=false to send raw "
                f"prompts, {key}=auto, or use a tokenizer with a template"
            )
        return True
    if value == "false":
        return False
    raise UserError(f"{key}={chat!r}: must be one of {list(CHAT_VALUES)}")


class PromptRenderer:
    """Prompt → (rendered text, token ids, the chat messages sent, or None for raw text)."""

    def __init__(
        self,
        tokenizer: Any,
        chat: bool,
        system_prompt: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer, self.chat, self.system_prompt = tokenizer, chat, system_prompt
        self.kwargs = dict(chat_template_kwargs or {})

    def settings(self) -> dict[str, Any]:
        """What decides the rendering (for reports and resume checks)."""
        return {"chat": self.chat, "chat_template_kwargs": dict(self.kwargs),
                "system_prompt": self.system_prompt}

    def __call__(self, p: PromptLike) -> tuple[str, list[int], list[dict[str, str]] | None]:
        where = getattr(p, "origin", None) or f"prompt {getattr(p, 'id', '?')}"
        if not self.chat:
            if p.messages is not None:
                raise UserError(f"{where}: chat-format prompt but chat is off (chat=false or the "
                                "tokenizer has no chat template)")
            return p.text or "", [int(t) for t in self.tokenizer(p.text)["input_ids"]], None
        if p.messages is not None:
            messages = p.messages
        else:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages = system + [{"role": "user", "content": p.text or ""}]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.kwargs
        )
        # The template already holds any BOS / special tokens.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text, [int(t) for t in ids], messages

    def ids(self, p: PromptLike) -> list[int]:
        """Token ids only."""
        return self(p)[1]
