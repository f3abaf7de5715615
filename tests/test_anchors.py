"""Semantic anchors come from the tokenizer's added tokens and its chat template."""

from __future__ import annotations

from hearth.engine.cache.anchors import anchor_positions, anchor_token_ids
from hearth.engine.text.tokenizer import load_tokenizer, render_chat


def test_anchors_are_the_template_markers(agent_checkpoint):
    tok = load_tokenizer(agent_checkpoint)
    anchors = anchor_token_ids(tok)
    names = {tok.convert_ids_to_tokens(i) for i in anchors}
    assert {"<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"} <= names
    assert "<|endoftext|>" not in names  # added, but the template never writes it


def test_checkpoint_positions_survive_an_openclaw_style_edit(agent_checkpoint):
    """Dropping an old thinking block keeps the prefix up to the anchor before it."""
    tok = load_tokenizer(agent_checkpoint)
    anchors = anchor_token_ids(tok)
    turn = [{"role": "user", "content": "list files"},
            {"role": "assistant", "content": "done", "reasoning_content": "I should call ls"},
            {"role": "user", "content": "thanks"}]
    edited = [dict(m) for m in turn]
    edited[1].pop("reasoning_content")
    full = tok.encode(render_chat(tok, turn), add_special_tokens=False)
    cut = tok.encode(render_chat(tok, edited), add_special_tokens=False)
    common = next((i for i, (a, b) in enumerate(zip(full, cut, strict=False)) if a != b), min(len(full), len(cut)))
    usable = [p for p in anchor_positions(full, anchors) if p <= common]
    assert usable and common - usable[-1] <= 4  # a checkpoint within a few tokens of the edit
    assert anchor_positions([], anchors) == []
    assert all(0 < p <= len(full) for p in anchor_positions(full, anchors))
