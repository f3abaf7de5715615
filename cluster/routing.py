"""The router's decisions as pure functions over a snapshot of the replicas.

- Session affinity: a request with a session key goes to the replica that wins rendezvous
  (highest-random-weight) hashing among the healthy replicas of its model. The choice is stable
  while the replica set stays the same, and when a replica leaves only its sessions move.
  A key the client gave (``x-session-id``) always sticks. A key derived from the prompt (the
  conversation's opening, a raw prompt's leading tokens) sticks only while that replica is not
  ``SLACK`` requests busier than the least busy one: a burst of identical prompts still spreads.
- Prefix-aware: without a client key, the replica holding the longest cached prefix of the prompt
  (its published block hashes, :func:`hearth.engine.cache.prefix_tree.block_hashes`) gets it, unless it
  has ``PREFIX_SLACK`` or more requests in flight beyond the least busy one; among equal prefixes the
  less busy, then the warmer expert cache.
- Otherwise the replica with the least expected wait: (requests in flight + 1) / decode speed,
  ties broken by the fewest requests assigned so far (so an idle cluster still alternates).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hearth.serving.session import CLIENT_KEY

SLACK = 2  # a derived session key yields to load once its replica has this many more requests in flight
PREFIX_SLACK = 3  # a cached prefix yields to load once its replica has this many more requests in flight


@dataclass(frozen=True)
class ReplicaLoad:
    """The router's view of one replica at decision time."""

    replica_id: str
    model: str
    healthy: bool
    in_flight: int = 0
    decode_tok_s: float = 0.0  # measured; 0 when not known yet
    assigned: int = 0  # requests routed here so far
    cached: frozenset[int] = frozenset()  # chained hashes of the prompt blocks its prefix cache holds
    block_size: int = 0  # of those blocks
    cache_warmth: float = 0.0  # its expert cache's hit ratio (0 without one)


def cached_prefix_tokens(replica: ReplicaLoad, prompt_hashes: Mapping[int, Sequence[int]]) -> int:
    """Prompt tokens whose blocks ``replica`` holds: its longest run of the prompt's chained block
    hashes (``prompt_hashes`` by block size) from the start."""
    blocks = 0
    for h in prompt_hashes.get(replica.block_size, ()):
        if h not in replica.cached:
            break
        blocks += 1
    return blocks * replica.block_size


def _weight(session_key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_key}\0{replica_id}".encode(), digest_size=8).digest(), "big")


def choose_replica(replicas: Iterable[ReplicaLoad], model: str, session_key: str | None = None,
                   exclude: frozenset[str] = frozenset(),
                   prompt_hashes: Mapping[int, Sequence[int]] | None = None) -> str | None:
    """The replica id to send a request to, or None when no healthy replica of ``model`` is left.
    ``prompt_hashes``: the prompt's chained block hashes by block size (for prefix routing)."""
    pool = [r for r in replicas if r.model == model and r.healthy and r.replica_id not in exclude]
    if not pool:
        return None
    least = min(r.in_flight for r in pool)
    home = max(pool, key=lambda r: (_weight(session_key, r.replica_id), r.replica_id)) if session_key else None
    if home is not None and session_key.startswith(CLIENT_KEY):
        return home.replica_id
    if prompt_hashes:
        best = max(pool, key=lambda r: (cached_prefix_tokens(r, prompt_hashes), -r.in_flight, r.cache_warmth,
                                        r.replica_id))
        if cached_prefix_tokens(best, prompt_hashes) > 0 and best.in_flight < least + PREFIX_SLACK:
            return best.replica_id
    if home is not None and home.in_flight < least + SLACK:
        return home.replica_id
    known = [r.decode_tok_s for r in pool if r.decode_tok_s > 0]
    default_speed = sum(known) / len(known) if known else 1.0  # unknown speed: assume the average

    def expected_wait(r: ReplicaLoad) -> tuple[float, int, str]:
        speed = r.decode_tok_s if r.decode_tok_s > 0 else default_speed
        return ((r.in_flight + 1) / speed, r.assigned, r.replica_id)

    return min(pool, key=expected_wait).replica_id
