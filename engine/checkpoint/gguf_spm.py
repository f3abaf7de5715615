"""A SentencePiece tokenizer (``tokenizer.model``) as llama.cpp's converter writes it into a GGUF
file (``tokenizer.ggml.model`` "llama"): every piece with its score and type, the checkpoint's added
tokens over them (``added_tokens.json``, then ``tokenizer_config.json``'s ``added_tokens_decoder``),
and the list padded to the model's vocabulary with unused ``[PADn]`` entries. The special-token ids,
``add_bos_token`` flags and chat template come from ``gguf.SpecialVocab``, the converter's own reader
of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hearth.engine.checkpoint.gguf_write_families import ConvertError

# llama.cpp's SentencePiece token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _processor(path: Path) -> Any:
    try:
        from sentencepiece import SentencePieceProcessor  # deferred: only SentencePiece checkpoints need it
    except ImportError:  # pragma: no cover - a dependency; a broken install still gets a clear line
        raise ConvertError("writing a SentencePiece tokenizer needs the sentencepiece package") from None
    if not path.is_file():
        raise ConvertError(f"{path.parent}: this family's GGUF tokenizer is SentencePiece, and there is no "
                           "tokenizer.model")
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(path))
    return sp


def _kind(sp: Any, i: int) -> int:
    for test, kind in ((sp.IsUnknown, UNKNOWN), (sp.IsControl, CONTROL), (sp.IsUnused, UNUSED), (sp.IsByte, BYTE)):
        if test(i):
            return kind
    return NORMAL


def _looks_special(text: str) -> bool:
    """Added tokens llama.cpp's converter treats as control tokens even when not marked special."""
    return text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>")) \
        or (text.startswith("<｜") and text.endswith("｜>")) or (text.startswith("<unused") and text.endswith(">"))


def sentencepiece_vocab(hf_dir: Path, vocab_size: int | None) -> tuple[list[bytes], list[float], list[int]]:
    """(tokens, scores, types) of ``hf_dir``'s SentencePiece tokenizer over ``vocab_size`` entries (the
    config's; the tokenizer's own size when None)."""
    sp = _processor(hf_dir / "tokenizer.model")
    size = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores, types = [-10000.0] * size, [UNUSED] * size
    for i in range(min(sp.vocab_size(), size)):
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode(), sp.GetScore(i), _kind(sp, i)
    added = hf_dir / "added_tokens.json"
    for text, i in (json.loads(added.read_text()) if added.is_file() else {}).items():
        if i < size:
            tokens[i], scores[i], types[i] = text.encode(), -1000.0, USER_DEFINED
    config = hf_dir / "tokenizer_config.json"
    decoder = json.loads(config.read_text()).get("added_tokens_decoder", {}) if config.is_file() else {}
    for key, token in decoder.items():
        i, text = int(key), token["content"]
        if i >= size:
            continue
        special = token.get("special") or _looks_special(text)
        text = text if special else text.replace("\u2581", " ")  # (user-defined spaces pre-normalised)
        tokens[i], scores[i], types[i] = text.encode(), -1000.0, CONTROL if special else USER_DEFINED
    return tokens, scores, types


def write_sentencepiece(writer: Any, hf_dir: Path, cfg: dict) -> None:
    """``hf_dir``'s SentencePiece tokenizer, special tokens and chat template into ``writer``."""
    import gguf  # deferred: the gguf package is needed for GGUF files only

    tokens, scores, types = sentencepiece_vocab(hf_dir, cfg.get("vocab_size"))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(writer)
