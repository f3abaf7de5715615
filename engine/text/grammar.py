"""Constrained decoding: a request's grammar masks the logits of every step, so the output can only
be text the grammar accepts (a JSON schema, a forced tool call; serving builds those grammars).

The grammars are llguidance's (JSON schemas and Lark-style grammars, compiled per request; a mask
costs ~0.1 ms per token on this tokenizer size). The tokenizer view walks the whole vocabulary
(seconds on a 150k one), so a server builds it with :meth:`Grammars.prepare` while it loads,
before it reports ready, and compiles each request's matcher on a worker thread
(:meth:`Grammars.matcher` is thread-safe): neither ever runs on the thread that steps the engine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from types import MappingProxyType
from typing import Any

import torch

log = logging.getLogger("hearth.engine")
# JSON laid out as json.dumps and the templates' tojson write it (what models see in training):
# free whitespace would let a small model pad until it runs out of tokens.
JSON_STYLE = MappingProxyType({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})


class GrammarError(ValueError):
    """The grammar does not compile (a bad schema): the request is refused."""


class GrammarTooSlow(GrammarError):
    """One step's mask took longer than the budget: the request ends with this error, alone."""


# A mask's CPU time (this thread's, so other threads' load does not count) past which its request
# ends. llguidance bounds a step by its own fuel limits (about 15 ms of lexing, 2.5 ms of Earley
# items); this catches whatever those do not, so that one grammar never slows every stream.
MASK_BUDGET_S = 0.1


class Grammars:
    """One engine's llguidance tokenizer and the matchers of its constrained requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 stop_token_ids: frozenset[int] = frozenset()) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.stop_token_ids = stop_token_ids  # the engine's end-of-reply tokens
        self._tokenizer = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Build the tokenizer view, import llguidance and warm its caches with one throwaway
        matcher and mask (a failure is logged: the first constrained request meets it again)."""
        try:
            self._ll_tokenizer()
            # One throwaway matcher and mask: the first constrained request then finds llguidance's
            # modules imported (an import holds the interpreter lock) and its caches warm.
            matcher = self.matcher(json_schema_grammar({"type": "object"}))
            matcher.mask(torch.zeros(self.vocab_size))
        except Exception:  # noqa: BLE001 - a constrained request will meet (and report) it again
            log.warning("constrained decoding: building the tokenizer view failed", exc_info=True)

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # deferred: imports transformers (seconds)

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_id)
            return self._tokenizer

    def matcher(self, grammar: str, stop_token_ids: list[int] = ()) -> Matcher:
        """A fresh matcher for one request (``stop_token_ids``: its own stop tokens besides the
        engine's); a grammar that does not compile is a GrammarError."""
        import llguidance  # deferred: loaded for the first constrained request (~0.25 s)

        tokenizer = self._ll_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(f"the output grammar is invalid: {'; '.join(messages)}")
        return Matcher(llguidance.LLMatcher(tokenizer, grammar, log_level=1), self.vocab_size,
                       self.stop_token_ids | frozenset(stop_token_ids))


class Matcher:
    """Where one request stands in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        import llguidance.torch  # deferred: as llguidance itself, on the first constrained request

        self._ll = matcher
        self.failed = False  # the grammar could not go on (nothing allowed, a token refused)
        self._stop_token_ids = stop_token_ids
        self._stop_ids = torch.tensor(sorted(t for t in stop_token_ids if t < vocab_size), dtype=torch.long)
        self._torch = llguidance.torch
        self._mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def mask(self, logits: torch.Tensor, raw: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` [V] with every token the grammar forbids next at -inf. End-of-reply tokens are
        forbidden too until the grammar may end (llguidance lets end-of-sequence close an open
        free-text lexeme). If the processed logits allow nothing the grammar does (a logits
        processor forbade it all), the model's own ``raw`` logits [V] are masked instead. A mask
        costing more than :data:`MASK_BUDGET_S` raises :class:`GrammarTooSlow`."""
        start = time.thread_time()
        self._torch.fill_next_token_bitmask(self._ll, self._mask, 0)
        spent = time.thread_time() - start
        if spent > MASK_BUDGET_S:
            self.failed = True
            raise GrammarTooSlow(f"the output grammar is too costly to enforce: one token's mask took {spent:.2f} s "
                                 f"of CPU (the budget is {MASK_BUDGET_S:g} s); simplify the schema's patterns")
        masked = self._masked(logits)
        if not torch.isinf(masked).all():
            return masked
        masked = self._masked(raw if raw is not None else torch.zeros_like(logits))  # rare: built only now
        if not torch.isinf(masked).all():
            return masked
        # Nothing allowed at all (cannot happen for a grammar that compiled): end the reply rather
        # than fail the engine step for every running request.
        log.warning("constrained decoding: the grammar allows no token (%s); ending the reply", self._ll.get_error())
        self.failed = True
        masked[self._stop_ids if len(self._stop_ids) else logits.argmax()] = 0.0
        return masked

    def _masked(self, source: torch.Tensor) -> torch.Tensor:
        masked = source.clone()
        masked.masked_fill_(~allowed_tokens(self._mask[0], masked.shape[-1]), float("-inf"))
        if not self._ll.is_accepting():
            masked[self._stop_ids] = float("-inf")
        return masked

    def advance(self, token: int) -> bool:
        """Take the sampled token; True when generation should stop: the grammar is complete, or
        the reply ended (an end-of-turn token) where the grammar may end."""
        if token in self._stop_token_ids and self._ll.is_accepting():
            return True
        if not self._ll.consume_token(token):  # cannot happen under the mask; never loop on it
            log.warning("constrained decoding: token %d was refused (%s); ending the reply", token,
                        self._ll.get_error())
            self.failed = True
            return True
        # The grammars built here end with a closing brace or tag: nothing may follow the first
        # state where the output is complete, so the reply ends there.
        return self._ll.is_stopped() or self._ll.is_accepting()


    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole sentence of the grammar (a reply ending otherwise
        reports ``length``, never a clean stop)."""
        return not self.failed and not self._ll.is_error() and (self._ll.is_accepting() or self._ll.is_stopped())


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool [vocab_size] of a token bitmask (int32 [ceil(V / 32)], bit j of word i: token
    32 i + j). Plain eager torch: llguidance's own helper is a ``torch.compile`` kernel, and a
    compilation sets torch's process-wide "compiling" flag, which would misroute the engine's eager
    ops on another thread (and compiles for seconds on the first constrained request)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [W, 32]
    return bits.reshape(-1)[:vocab_size].bool()


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON matching ``schema`` (``{"type": "object"}`` for any object), laid out
    as :data:`JSON_STYLE` says."""
    import llguidance  # deferred: serving builds grammars with this; only requests with a schema load it

    return llguidance.grammar_from("json_schema", json.dumps({**schema, "x-guidance": dict(JSON_STYLE)}))
