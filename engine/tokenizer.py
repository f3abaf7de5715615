"""Tokenizer and chat template, read from the checkpoint directory (never downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The checkpoint's tokenizer, or None when the directory ships none (a GGUF file's comes
    from its metadata, with its chat template)."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir.parent), gguf_file=model_dir.name)
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    """Render messages with the checkpoint's chat template, ready for the assistant's reply."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint has no chat template")
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
