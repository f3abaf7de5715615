"""Constrained decoding: a request's grammar masks the logits of every step, so the output can only
be text the grammar accepts (a JSON schema, a forced tool call; serving builds those grammars).

The grammars are llguidance's (JSON schemas and Lark-style grammars, compiled lazily per request;
a mask costs ~0.1 ms per token on this tokenizer size). The tokenizer view is built once per
engine, on the first constrained request, because building it walks the whole vocabulary.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

log = logging.getLogger("hearth.engine")


class GrammarError(ValueError):
    """The grammar does not compile (a bad schema): the request is refused."""


class Grammars:
    """One engine's llguidance tokenizer and the matchers of its constrained requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 stop_token_ids: frozenset[int] = frozenset()) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.stop_token_ids = stop_token_ids  # the engine's end-of-reply tokens
        self._tokenizer = None

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_id)
        return self._tokenizer

    def matcher(self, grammar: str, stop_token_ids: list[int] = ()) -> Matcher:
        """A fresh matcher for one request (``stop_token_ids``: its own stop tokens besides the
        engine's); a grammar that does not compile is a GrammarError."""
        import llguidance

        tokenizer = self._ll_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(f"the output grammar is invalid: {'; '.join(messages)}")
        return Matcher(llguidance.LLMatcher(tokenizer, grammar, log_level=1), self.vocab_size,
                       self.stop_token_ids | frozenset(stop_token_ids))


class Matcher:
    """Where one request stands in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        import llguidance.torch

        self._ll = matcher
        self._stop_token_ids = stop_token_ids
        self._torch = llguidance.torch
        self._mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] with every token the grammar forbids next at -inf."""
        self._torch.fill_next_token_bitmask(self._ll, self._mask, 0)
        masked = logits.clone()
        self._torch.apply_token_bitmask_inplace(masked, self._mask[0])
        if torch.isinf(masked).all():  # a logits processor forbade every token the grammar allows:
            masked = torch.zeros_like(logits)  # the grammar wins, sampling among what it allows
            self._torch.apply_token_bitmask_inplace(masked, self._mask[0])
        return masked

    def advance(self, token: int) -> bool:
        """Take the sampled token; True when generation should stop: the grammar is complete, or
        the reply ended (an end-of-turn token) where the grammar may end."""
        if token in self._stop_token_ids and self._ll.is_accepting():
            return True
        if not self._ll.consume_token(token):  # cannot happen under the mask; never loop on it
            log.warning("constrained decoding: token %d was refused (%s); ending the reply", token,
                        self._ll.get_error())
            return True
        # The grammars built here end with a closing brace or tag: nothing may follow the first
        # state where the output is complete, so the reply ends there.
        return self._ll.is_stopped() or self._ll.is_accepting()


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON matching ``schema`` (``{"type": "object"}`` for any object), laid out
    as json.dumps writes it: flexible whitespace lets a small model pad until it runs out of tokens."""
    import llguidance

    style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return llguidance.grammar_from("json_schema", json.dumps({**schema, "x-guidance": style}))
