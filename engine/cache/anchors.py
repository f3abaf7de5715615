"""Semantic anchors: token boundaries that agent edits of a conversation leave in place.

Agent clients resend their history each turn, edited: old thinking blocks dropped, old tool
results shortened. Such edits cut at the structural markers the chat template emits (message
starts and ends, thinking and tool-call and tool-result tags), so the prefix up to a marker tends to
survive the next turn. Recurrent-state checkpoints taken at those positions can then be restored
instead of recomputing the whole history.

The markers are discovered, not hard-coded per model: a token is an anchor when the tokenizer
treats it as one unit (a special or added token) *and* the chat template writes it literally.
"""

from __future__ import annotations

from typing import Any


def anchor_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the added/special tokens that the tokenizer's chat template emits."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a dict of named templates
        template = "\n".join(str(t) for t in dict(template).values())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(i for i, tok in added.items() if str(tok) and str(tok) in template)


def anchor_positions(token_ids: list[int], anchors: frozenset[int]) -> list[int]:
    """Prefix lengths at which to checkpoint: just before and just after every anchor token (an
    edit may remove what follows a marker, or the marked block itself). Sorted, within
    1..len(token_ids)."""
    positions = set()
    for i, token in enumerate(token_ids):
        if token in anchors:
            positions.update((i, i + 1))
    positions.discard(0)
    return sorted(p for p in positions if p <= len(token_ids))
