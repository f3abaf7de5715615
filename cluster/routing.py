"""The router's decisions as pure functions over a snapshot of the replicas.

- Session affinity: a request with a session key goes to the replica that wins rendezvous
  (highest-random-weight) hashing among the healthy replicas of its model. The choice is stable
  while the replica set stays the same, and when a replica leaves only its sessions move.
  A key the client gave (``x-session-id``) always sticks. A key derived from the prompt (the
  conversation's opening, a raw prompt's leading tokens) sticks only while that replica is not
  ``SLACK`` requests busier than the least busy one: a burst of identical prompts still spreads.
- Otherwise the replica with the least expected wait: (requests in flight + 1) / decode speed,
  ties broken by the fewest requests assigned so far (so an idle cluster still alternates).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from hearth.serving.session import CLIENT_KEY

SLACK = 2  # a derived session key yields to load once its replica has this many more requests in flight


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
        home = max(pool, key=lambda r: (_weight(session_key, r.replica_id), r.replica_id))
        least = min(r.in_flight for r in pool)
        if session_key.startswith(CLIENT_KEY) or home.in_flight < least + SLACK:
            return home.replica_id
    known = [r.decode_tok_s for r in pool if r.decode_tok_s > 0]
    default_speed = sum(known) / len(known) if known else 1.0  # unknown speed: assume the average

    def expected_wait(r: ReplicaLoad) -> tuple[float, int, str]:
        speed = r.decode_tok_s if r.decode_tok_s > 0 else default_speed
        return ((r.in_flight + 1) / speed, r.assigned, r.replica_id)

    return min(pool, key=expected_wait).replica_id
