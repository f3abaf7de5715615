"""Tokenizer and chat template, read from the checkpoint directory (never downloaded)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hearth.engine.config import config_architectures

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# Chat templates for architectures whose checkpoints ship their conversation format as code, not as
# a template: used when the tokenizer has none.
BUILTIN_TEMPLATES = {"DeepseekV4ForCausalLM": "deepseek_v4.jinja", "DeepseekV32ForCausalLM": "deepseek_v32.jinja"}

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The checkpoint's tokenizer, or None when the directory ships none (a GGUF file's comes
    from its metadata, with its chat template)."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        return _gguf_tokenizer(model_dir)
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        builtin = builtin_template(model_dir)
        if builtin is not None:
            log.info("%s ships no chat template: using hearth's %s", model_dir, builtin.name)
            tokenizer.chat_template = builtin.read_text()
    return tokenizer


def _gguf_tokenizer(path: Path) -> Any:
    """A GGUF file's tokenizer. transformers' AutoTokenizer first looks the architecture up in its
    GGUF config mapping, which lacks (or fails on) several families hearth reads; the fast tokenizer built from
    the file's ``tokenizer.ggml.*`` keys alone (the same conversion) serves those."""
    # deferred: transformers takes seconds to import
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, TypeError, KeyError) as exc:  # its config mapping lacks or trips on the architecture
        log.debug("AutoTokenizer cannot read %s (%s); building the tokenizer from its tokenizer keys", path, exc)
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def builtin_template(model_dir: Path) -> Path | None:
    """hearth's chat template for the checkpoint's architecture (see ``BUILTIN_TEMPLATES``), if any."""
    try:
        architectures = config_architectures(json.loads((model_dir / "config.json").read_text()))
    except (OSError, json.JSONDecodeError):
        return None
    names = [BUILTIN_TEMPLATES[a] for a in architectures if a in BUILTIN_TEMPLATES]
    return Path(__file__).parent / "templates" / names[0] if names else None


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    """Render messages with the checkpoint's chat template, ready for the assistant's reply."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint has no chat template")
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
