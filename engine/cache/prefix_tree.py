"""A radix tree over token ids whose edges own whole KV blocks: prefix reuse across requests.

Every edge is a run of *full* blocks: ``tokens`` (a multiple of the block size) and the KV block
ids that hold them. A prompt reuses the blocks of its longest matching prefix of whole blocks;
since a request only ever appends after that prefix, into blocks of its own, a block in the tree is
never written again — no copy-on-write and no stale page. Requests pin the path they use
(:meth:`RadixCache.lock`); unpinned leaves are evicted least recently used first when the block
allocator runs dry. Pure bookkeeping, no tensors (unit-testable), like the block allocator.

Nodes are also where recurrent-state checkpoints of hybrid models hang
(:mod:`hearth.engine.cache.state_checkpoints`): a checkpoint at a block boundary inside an edge splits the edge
there, so each checkpoint sits at the end of its node; ``on_evict`` hears of every evicted node.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from hearth.proto.prefix import chain_block


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree (the root has an empty one)."""

    tokens: tuple[int, ...]
    blocks: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # keyed by their first block
    ref: int = 0  # requests using this node (and so every node above it)
    last_access: int = 0
    checkpoint: object | None = None  # a hybrid model's recurrent state after this edge (StateCheckpoint)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence: ``num_tokens`` tokens in ``blocks``, ending in
    ``node`` (lock it while the blocks are in use)."""

    num_tokens: int
    blocks: list[int]
    node: RadixNode


class RadixCache:
    """The shared prefix tree (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.root = RadixNode((), [], None)
        self.root.ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_blocks = 0  # blocks the tree owns
        self.on_evict: Callable[[RadixNode], None] | None = None

    def _key(self, tokens: tuple[int, ...] | list[int], at: int = 0) -> tuple[int, ...]:
        return tuple(tokens[at : at + self.block_size])

    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest prefix of ``tokens`` made of whole cached blocks (touches it for LRU)."""
        now = next(self._clock)
        node, pos, blocks = self.root, 0, []
        while pos + self.block_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            shared = self._common_blocks(child.tokens, tokens, pos)
            if shared < len(child.blocks):
                child = self._split(child, shared)
            blocks += child.blocks
            pos += len(child.tokens)
            child.last_access = now
            node = child
        return PrefixMatch(pos, blocks, node)

    def insert(self, tokens: list[int], blocks: list[int]) -> tuple[RadixNode, list[int]]:
        """Add the whole blocks of ``tokens`` (``blocks[i]`` holds block i) to the tree. Returns the
        node of the last whole block and the tree's block ids for those blocks: where one differs
        from the caller's, the tree already held those tokens, so the caller frees its own block
        and uses the tree's. The caller's other blocks now belong to the tree."""
        n_full = min(len(tokens) // self.block_size, len(blocks))
        tokens = tokens[: n_full * self.block_size]
        found = self.match(tokens)
        start = len(found.blocks)
        if start == n_full:
            return found.node, found.blocks
        rest = tuple(tokens[start * self.block_size :])
        node = RadixNode(rest, list(blocks[start:n_full]), found.node, last_access=next(self._clock))
        found.node.children[self._key(rest)] = node
        self.num_blocks += len(node.blocks)
        return node, found.blocks + node.blocks

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors: their blocks are in use by a request."""
        while node is not None:
            node.ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            if node.ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.ref -= 1
            node = node.parent

    def evictable_blocks(self) -> int:
        """Blocks held only by the tree (no request uses them)."""
        return sum(len(n.blocks) for n in self._nodes() if n.ref == 0)

    def evict(self, num_blocks: int) -> list[int]:
        """Free at least ``num_blocks`` blocks (fewer if not enough are unpinned), least recently
        used leaves first; returns the freed block ids."""
        freed: list[int] = []
        while len(freed) < num_blocks:
            leaves = [n for n in self._nodes() if n.is_leaf and n.ref == 0 and n is not self.root]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_access)
            del victim.parent.children[self._key(victim.tokens)]
            freed += victim.blocks
            self.num_blocks -= len(victim.blocks)
            if self.on_evict is not None:
                self.on_evict(victim)
        return freed

    def _common_blocks(self, edge: tuple[int, ...], tokens: list[int], pos: int) -> int:
        """How many whole blocks of ``edge`` equal ``tokens`` from ``pos`` on."""
        n = 0
        for i in range(0, len(edge), self.block_size):
            if pos + i + self.block_size > len(tokens):
                break
            if edge[i : i + self.block_size] != tuple(tokens[pos + i : pos + i + self.block_size]):
                break
            n += 1
        return n

    def _split(self, node: RadixNode, blocks: int) -> RadixNode:
        """Cut ``node``'s edge after ``blocks`` blocks; returns the new upper node."""
        cut = blocks * self.block_size
        upper = RadixNode(node.tokens[:cut], node.blocks[:blocks], node.parent, ref=node.ref,
                          last_access=node.last_access)
        node.parent.children[self._key(upper.tokens)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[blocks:], upper
        upper.children[self._key(node.tokens)] = node
        return upper

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def block_hashes(self, limit: int) -> list[int]:
        """The chained hashes (:func:`hearth.proto.prefix.block_hashes`) of the tree's blocks, at most
        ``limit`` of them, the most recently used first: what a router needs to know which prefixes
        are cached here."""
        found: list[tuple[int, int]] = []  # (last access, hash)
        stack = [(child, b"") for child in self.root.children.values()]
        while stack:
            node, digest = stack.pop()
            for start in range(0, len(node.tokens), self.block_size):
                digest = chain_block(digest, node.tokens[start : start + self.block_size])
                found.append((node.last_access, int.from_bytes(digest, "little")))
            stack += [(child, digest) for child in node.children.values()]
        found.sort(key=lambda item: -item[0])
        return [h for _, h in found[:limit]]

