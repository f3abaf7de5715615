"""The radix prefix tree: whole-block matches, splits, dedup, pins and LRU eviction."""

from __future__ import annotations

import random

import pytest

from hearth.engine.cache.prefix_tree import RadixCache

B = 4


def seq(*blocks: int) -> list[int]:
    """A token sequence of whole blocks, block i made of the value blocks[i]."""
    return [v for v in blocks for _ in range(B)]


def test_match_returns_the_blocks_of_the_longest_whole_block_prefix():
    cache = RadixCache(B)
    cache.insert(seq(1, 2, 3) + [9, 9], [10, 11, 12, 13])  # the partial last block is not cached
    assert cache.num_blocks == 3
    m = cache.match(seq(1, 2, 3, 4))
    assert (m.num_tokens, m.blocks) == (12, [10, 11, 12])
    m = cache.match(seq(1, 2) + [3, 3, 3])  # a partial third block does not match
    assert (m.num_tokens, m.blocks) == (8, [10, 11])
    assert cache.match(seq(5)).num_tokens == 0


def test_a_diverging_prefix_splits_the_edge_and_shares_the_common_blocks():
    cache = RadixCache(B)
    cache.insert(seq(1, 2, 3), [10, 11, 12])
    node, tree_blocks = cache.insert(seq(1, 2, 7), [20, 21, 22])
    assert tree_blocks == [10, 11, 22]  # the tree already holds blocks 1, 2 in 10, 11: 20, 21 are redundant
    assert cache.num_blocks == 4
    assert cache.match(seq(1, 2, 7)).blocks == [10, 11, 22]
    assert cache.match(seq(1, 2, 3)).blocks == [10, 11, 12]
    assert cache.match(seq(1, 2, 3)).node.parent is cache.match(seq(1, 2, 7)).node.parent


def test_eviction_frees_unpinned_leaves_least_recently_used_first():
    cache = RadixCache(B)
    a, _ = cache.insert(seq(1, 2), [10, 11])
    cache.insert(seq(1, 3), [20, 21])
    cache.insert(seq(4), [30])
    cache.lock(a)
    cache.match(seq(4))  # most recently used
    assert cache.evictable_blocks() == 2  # block 21 (leaf 3) and 30; the shared block 1 is pinned by a
    assert cache.evict(1) == [21]
    assert cache.evict(5) == [30]  # only what is unpinned
    cache.unlock(a)
    assert sorted(cache.evict(5)) == [10, 11]
    assert cache.num_blocks == 0
    with pytest.raises(RuntimeError):
        cache.unlock(a)


def test_randomized_against_a_reference_map():
    """Random requests over a small alphabet (so prefixes are shared and diverge): every match
    equals the reference's longest cached prefix, and eviction never frees a pinned block or one
    still reachable."""
    rng = random.Random(0)
    cache = RadixCache(B)
    ref: dict[tuple[int, ...], int] = {}  # whole-block prefix -> the block id holding its last block
    next_block = 0
    pinned: list = []
    for _ in range(400):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 6 * B))]
        m = cache.match(tokens)
        expect = []
        for i in range(len(tokens) // B):
            key = tuple(tokens[: (i + 1) * B])
            if key not in ref:
                break
            expect.append(ref[key])
        assert m.blocks == expect and m.num_tokens == len(expect) * B
        own = list(range(next_block, next_block + len(tokens) // B))
        next_block += len(own)
        node, tree_blocks = cache.insert(tokens, m.blocks + own[len(m.blocks):])
        assert tree_blocks == (m.blocks + own[len(m.blocks):])[: len(tokens) // B]
        for i in range(len(tokens) // B):
            ref.setdefault(tuple(tokens[: (i + 1) * B]), (m.blocks + own[len(m.blocks):])[i])
        if rng.random() < 0.3:
            cache.lock(node)
            pinned.append((node, tokens))
        if pinned and rng.random() < 0.2:
            cache.unlock(pinned.pop(rng.randrange(len(pinned)))[0])
        if rng.random() < 0.3:
            freed = set(cache.evict(rng.randrange(1, 4)))
            for _, toks in pinned:  # pinned paths keep every block
                assert not freed & set(cache.match(toks).blocks)
            ref = {k: v for k, v in ref.items() if v not in freed}
        assert cache.num_blocks == len(set(ref.values()))
