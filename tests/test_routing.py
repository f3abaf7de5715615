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
