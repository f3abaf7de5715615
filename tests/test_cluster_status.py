"""The ``hearth status`` table (a pure function of the status dict)."""

from __future__ import annotations

from hearth.cli.cluster import format_status


def test_status_table_has_a_row_per_replica() -> None:
    status = {"model": "tiny", "url": "http://127.0.0.1:8000", "rows": [
        {"replica": "tiny@desktop", "node": "desktop", "executor": "cuda", "gpu": 0, "cache_bytes": 20 << 30,
         "healthy": True, "in_flight": 2, "assigned": 9, "decode_tok_s": 61.96, "last_error": None, "state": "ready",
         "running": 2, "hit_rate": 0.713, "b_p": 49.0e9, "b_h": 53.8e9, "qtable": list(range(65)),
         "bandwidth_changes": 1},
        {"replica": "tiny@laptop", "node": "laptop", "executor": "cpu", "gpu": None, "cache_bytes": 0,
         "healthy": False, "in_flight": 0, "assigned": 3, "decode_tok_s": 0.0, "last_error": "ActorDiedError",
         "state": "down"},
    ]}
    lines = format_status(status).splitlines()
    assert lines[0] == "model tiny at http://127.0.0.1:8000"
    assert lines[1].split()[:3] == ["REPLICA", "NODE", "STATE"]
    desktop, laptop = lines[2].split(), lines[3].split()
    assert desktop == ["tiny@desktop", "desktop", "ready", "cuda", "0", "20.0", "GiB", "49.0", "53.8", "1,2,4,8",
                       "71%", "62.0", "2"]
    assert laptop == ["tiny@laptop", "laptop", "down", "cpu", "-", "-", "-", "-", "-", "-", "0.0", "0"]


def test_a_ready_replica_out_of_rotation_reads_out() -> None:
    row = {"replica": "m@a", "node": "a", "executor": "cpu", "gpu": None, "cache_bytes": 0, "healthy": False,
           "state": "ready"}
    assert format_status({"model": "m", "url": "u", "rows": [row]}).splitlines()[2].split()[2] == "out"


def test_a_split_model_lists_its_stages() -> None:
    row = {"replica": "big@desktop", "node": "desktop", "executor": "cpu", "gpu": None, "cache_bytes": 0,
           "healthy": True, "state": "ready"}
    stages = [{"model": "big", "index": 0, "node_name": "desktop", "first_layer": 0, "end_layer": 30,
               "executor": "cuda", "healthy": True},
              {"model": "big", "index": 1, "node_name": "laptop", "first_layer": 30, "end_layer": 48,
               "executor": "cpu", "healthy": False, "error": "ActorUnavailableError"}]
    lines = format_status({"model": "big", "url": "u", "rows": [row], "stage_rows": stages}).splitlines()
    assert lines[4] == "pipeline stages:" and lines[5].split() == ["STAGE", "NODE", "LAYERS", "EXEC", "STATE"]
    assert lines[6].split() == ["big/0", "desktop", "0-29", "cuda", "serving"]
    assert lines[7].split() == ["big/1", "laptop", "30-47", "cpu", "ActorUnavailableError"]
    assert "pipeline" not in format_status({"model": "m", "url": "u", "rows": [row]})
