"""Small helpers the benchmark scripts share."""

from __future__ import annotations

import json
from pathlib import Path


def synthetic_prompt(vocab_size: int, length: int, salt: int = 0) -> list[int]:
    """A fixed, spread-out sequence of token ids (the same prompt in every benchmark); another
    ``salt`` gives another sequence, sharing no prefix with it."""
    span = min(vocab_size, 30000) - 1
    return [(i * 7919 + salt * 104729 + salt) % span + 1 for i in range(length)]  # ids in [1, vocab)


def emit(result: dict, path: Path | None) -> None:
    """Print the result as one JSON line, and write it (indented) to ``path`` when given."""
    print(json.dumps(result))
    if path:
        path.write_text(json.dumps(result, indent=2))
