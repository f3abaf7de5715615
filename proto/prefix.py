"""The prefix-cache contract between engines and routers: a prompt's whole blocks named by chained
64-bit hashes, so that a replica can publish which prefixes it holds and a router can tell, from
the prompt alone, how long a prefix each replica has cached."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_block(previous: bytes, block: Sequence[int]) -> bytes:
    """The digest of a prefix: the previous blocks' digest (b"" at the start) and this block's ids."""
    return hashlib.blake2b(previous + array("q", block).tobytes(), digest_size=8).digest()


def block_hashes(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Chained hashes of the whole blocks of ``tokens``: entry i names the prefix of its first
    i + 1 blocks (two sequences share entry i exactly when they share those blocks)."""
    out: list[int] = []
    digest = b""
    count = len(tokens) // block_size if limit is None else min(len(tokens) // block_size, limit)
    for i in range(count):
        digest = chain_block(digest, tokens[i * block_size : (i + 1) * block_size])
        out.append(int.from_bytes(digest, "little"))
    return out
