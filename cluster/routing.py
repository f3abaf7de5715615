"""The router's decisions as pure functions over a snapshot of the replicas.

- Session affinity: a request with a session key goes to the replica that wins rendezvous
  (highest-random-weight) hashing among the healthy replicas of its model. The choice is stable
  while the replica set stays the same, and when a replica leaves only its sessions move.
- Otherwise the replica with the least expected wait: (requests in flight + 1) / decode speed,
  ties broken by the fewest requests assigned so far (so an idle cluster still alternates).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PREFIX_KEY_TOKENS = 256  # raw prompts: the session is identified by this many leading tokens


@dataclass(frozen=True)
class ReplicaLoad:
    """The router's view of one replica at decision time."""

    replica_id: str
    model: str
    healthy: bool
    in_flight: int = 0
    decode_tok_s: float = 0.0  # measured; 0 when not known yet
    assigned: int = 0  # requests routed here so far


def _weight(session_key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_key}\0{replica_id}".encode(), digest_size=8).digest(), "big")


def choose_replica(replicas: Iterable[ReplicaLoad], model: str, session_key: str | None = None,
                   exclude: frozenset[str] = frozenset()) -> str | None:
    """The replica id to send a request to, or None when no healthy replica of ``model`` is left."""
    pool = [r for r in replicas if r.model == model and r.healthy and r.replica_id not in exclude]
    if not pool:
        return None
    if session_key is not None:
        return max(pool, key=lambda r: (_weight(session_key, r.replica_id), r.replica_id)).replica_id
    known = [r.decode_tok_s for r in pool if r.decode_tok_s > 0]
    default_speed = sum(known) / len(known) if known else 1.0  # unknown speed: assume the average

    def expected_wait(r: ReplicaLoad) -> tuple[float, int, str]:
        speed = r.decode_tok_s if r.decode_tok_s > 0 else default_speed
        return ((r.in_flight + 1) / speed, r.assigned, r.replica_id)

    return min(pool, key=expected_wait).replica_id


def conversation_key(messages: list[dict[str, Any]]) -> str:
    """A session key for a chat: the messages up to and including the first user message (the
    system prompt and the opening question identify a conversation; later turns only append)."""
    head: list[dict[str, Any]] = []
    for m in messages:
        head.append({"role": m.get("role"), "content": m.get("content")})
        if m.get("role") == "user":
            break
    return "conv:" + hashlib.blake2b(json.dumps(head, sort_keys=True, default=str).encode(),
                                     digest_size=12).hexdigest()


def prefix_key(prompt_ids: list[int]) -> str:
    """A session key for a raw prompt: a hash of its leading tokens."""
    head = prompt_ids[:PREFIX_KEY_TOKENS]
    return "prefix:" + hashlib.blake2b(json.dumps(head).encode(), digest_size=12).hexdigest()
