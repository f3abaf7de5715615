"""The router's replica choice as a pure function."""

from __future__ import annotations

from hearth.cluster.routing import ReplicaLoad, choose_replica
from hearth.serving.session import conversation_key, prefix_key, session_key


def replicas(**overrides) -> list[ReplicaLoad]:
    base = {"m@desktop": ReplicaLoad("m@desktop", "m", True), "m@laptop": ReplicaLoad("m@laptop", "m", True),
            "other@desktop": ReplicaLoad("other@desktop", "other", True)}
    for rid, fields in overrides.items():
        base[rid.replace("_", "@")] = ReplicaLoad(rid.replace("_", "@"), **fields)
    return list(base.values())


def test_routes_by_model_and_skips_unhealthy_and_excluded() -> None:
    rs = replicas(m_desktop={"model": "m", "healthy": False})
    assert choose_replica(rs, "m") == "m@laptop"
    assert choose_replica(rs, "other") == "other@desktop"
    assert choose_replica(rs, "m", exclude=frozenset({"m@laptop"})) is None
    assert choose_replica(rs, "missing") is None


def test_least_expected_wait_uses_load_and_speed() -> None:
    rs = replicas(m_desktop={"model": "m", "healthy": True, "in_flight": 2, "decode_tok_s": 30.0},
                  m_laptop={"model": "m", "healthy": True, "in_flight": 0, "decode_tok_s": 10.0})
    assert choose_replica(rs, "m") == "m@desktop"  # 3/30 < 1/10
    rs = replicas(m_desktop={"model": "m", "healthy": True, "in_flight": 4, "decode_tok_s": 30.0},
                  m_laptop={"model": "m", "healthy": True, "in_flight": 0, "decode_tok_s": 10.0})
    assert choose_replica(rs, "m") == "m@laptop"  # 5/30 > 1/10


def test_idle_equal_replicas_alternate_by_assignment_count() -> None:
    rs = replicas(m_desktop={"model": "m", "healthy": True, "assigned": 3},
                  m_laptop={"model": "m", "healthy": True, "assigned": 2})
    assert choose_replica(rs, "m") == "m@laptop"


def test_unknown_speed_counts_as_the_average() -> None:
    rs = replicas(m_desktop={"model": "m", "healthy": True, "in_flight": 1, "decode_tok_s": 20.0},
                  m_laptop={"model": "m", "healthy": True, "in_flight": 0})
    assert choose_replica(rs, "m") == "m@laptop"


def test_session_affinity_is_stable_spread_and_moves_only_lost_sessions() -> None:
    rs = replicas()
    keys = [f"id:session-{i}" for i in range(64)]
    first = {k: choose_replica(rs, "m", k) for k in keys}
    # Load does not move a session.
    loaded = replicas(m_desktop={"model": "m", "healthy": True, "in_flight": 50},
                      m_laptop={"model": "m", "healthy": True, "in_flight": 0})
    assert {k: choose_replica(loaded, "m", k) for k in keys} == first
    assert set(first.values()) == {"m@desktop", "m@laptop"}
    # One replica leaves: its sessions move to the survivor, the others stay put.
    gone = replicas(m_desktop={"model": "m", "healthy": False})
    assert all(choose_replica(gone, "m", k) == "m@laptop" for k in keys)
    assert all(choose_replica(gone, "m", k) == first[k] for k in keys if first[k] == "m@laptop")


def test_derived_session_keys_yield_to_load() -> None:
    key = "prefix:abc"
    home = choose_replica(replicas(), "m", key)
    other = "m@laptop" if home == "m@desktop" else "m@desktop"
    busy = {home.replace("@", "_"): {"model": "m", "healthy": True, "in_flight": 1}}
    assert choose_replica(replicas(**busy), "m", key) == home  # within the slack: stays
    busy[home.replace("@", "_")]["in_flight"] = 2
    assert choose_replica(replicas(**busy), "m", key) == other  # two more than the idle one: moves
    assert choose_replica(replicas(**busy), "m", "id:abc") in (home, other)  # client keys never move...
    client_home = choose_replica(replicas(), "m", "id:abc")
    very_busy = {client_home.replace("@", "_"): {"model": "m", "healthy": True, "in_flight": 50}}
    assert choose_replica(replicas(**very_busy), "m", "id:abc") == client_home  # ...however busy


def test_session_key_prefers_the_client_header() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert session_key(" s1 ", msgs) == "id:s1"
    assert session_key(None, msgs) == conversation_key(msgs)
    assert session_key("", None, [1, 2]) == prefix_key([1, 2])


def test_conversation_key_ignores_later_turns_and_prefix_key_leading_tokens() -> None:
    opening = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = opening + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert conversation_key(opening) == conversation_key(later)
    assert conversation_key(opening) != conversation_key([{"role": "user", "content": "other"}])
    assert prefix_key(list(range(300))) == prefix_key(list(range(300)) + [1, 2])
    assert prefix_key([1, 2, 3]) != prefix_key([1, 2, 4])


def test_block_hashes_name_shared_prefixes_and_the_tree_publishes_them() -> None:
    from hearth.engine.cache.prefix_tree import RadixCache
    from hearth.proto.prefix import block_hashes

    a, b = list(range(40)), list(range(32)) + [99] * 8
    ha, hb = block_hashes(a, 8), block_hashes(b, 8)
    assert len(ha) == 5 and ha[:4] == hb[:4] and ha[4] != hb[4]
    assert block_hashes(a, 8, limit=2) == ha[:2] and block_hashes(a[:7], 8) == []
    tree = RadixCache(8)
    tree.insert(a, list(range(5)))
    tree.insert(b, list(range(5, 10)))  # shares 4 blocks: one new block
    assert set(tree.block_hashes(100)) == set(ha) | set(hb)
    assert len(tree.block_hashes(3)) == 3


def test_prefix_routing_prefers_the_longest_cached_prefix_until_load_overrides() -> None:
    from hearth.cluster.routing import PREFIX_SLACK, cached_prefix_tokens
    from hearth.proto.prefix import block_hashes

    prompt = list(range(100, 164))  # 4 blocks of 16
    hashes = {16: block_hashes(prompt, 16)}
    laptop = {"model": "m", "healthy": True, "cached": frozenset(hashes[16][:3]), "block_size": 16}
    desktop = {"model": "m", "healthy": True, "cached": frozenset(hashes[16][:1]), "block_size": 16,
               "decode_tok_s": 50.0}
    rs = replicas(m_laptop=laptop, m_desktop=desktop)
    assert [cached_prefix_tokens(r, hashes) for r in rs[:2]] == [16, 48]
    assert choose_replica(rs, "m", prompt_hashes=hashes) == "m@laptop"  # though the desktop is faster
    # A prefix the laptop lacks the start of counts nothing there.
    assert cached_prefix_tokens(ReplicaLoad("x", "m", True, cached=frozenset(hashes[16][1:]), block_size=16),
                                hashes) == 0
    busy = replicas(m_laptop={**laptop, "in_flight": PREFIX_SLACK - 1}, m_desktop=desktop)
    assert choose_replica(busy, "m", prompt_hashes=hashes) == "m@laptop"
    busy = replicas(m_laptop={**laptop, "in_flight": PREFIX_SLACK}, m_desktop=desktop)
    assert choose_replica(busy, "m", prompt_hashes=hashes) == "m@desktop"  # load overrides
    # A client's session id still wins; a prompt nobody caches goes by load.
    client = next(f"id:s{i}" for i in range(100) if choose_replica(rs, "m", f"id:s{i}") == "m@desktop")
    assert choose_replica(rs, "m", client, prompt_hashes=hashes) == "m@desktop"
    cold = {16: block_hashes(list(range(500, 564)), 16)}
    assert choose_replica(rs, "m", prompt_hashes=cold) == "m@desktop"  # the faster one, by expected wait
    # Equal prefixes: the less busy, then the warmer expert cache.
    same = {**laptop, "cached": frozenset(hashes[16])}
    rs = replicas(m_laptop={**same, "cache_warmth": 0.2}, m_desktop={**same, "cache_warmth": 0.9})
    assert choose_replica(rs, "m", prompt_hashes=hashes) == "m@desktop"
    rs = replicas(m_laptop={**same, "cache_warmth": 0.2}, m_desktop={**same, "cache_warmth": 0.9, "in_flight": 1})
    assert choose_replica(rs, "m", prompt_hashes=hashes) == "m@laptop"
