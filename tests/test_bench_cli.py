"""``hearth bench``: in-process, against transformers, with cache fractions, and against a server."""

from __future__ import annotations

import json

from hearth.cli.main import main
from tests.serving_helpers import running_server


def _rows(path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def test_bench_in_process_and_transformers(checkpoint, tmp_path, capsys):
    path, _ = checkpoint("qwen3_moe")
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(path), "-p", "16", "-n", "4", "-r", "2", "-d", "0", "16",
                 "--transformers", "--cache-fraction", "0.5", "--json", str(out)]) == 0
    rows = _rows(out)
    cells = {(r["backend"], r["test"], r["depth"]) for r in rows}
    for backend in ("hearth", "hearth cache 0.5", "transformers"):
        for test in ("pp16", "tg4", "ttft16"):
            assert {(backend, test, 0), (backend, test, 16)} <= cells
    assert all(len(r["samples"]) == 2 and r["median"] > 0 for r in rows)
    table = capsys.readouterr().out
    assert "| model | backend | test | depth |" in table and "vs hearth" in table


def test_bench_rejects_bad_sweeps(checkpoint, capsys):
    path, _ = checkpoint("qwen3_moe")
    assert main(["bench", "--model", str(path), "-p", "16", "-d", "10"]) == 1
    assert "multiples of --n-prompt" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--transformers"]) == 1


def test_bench_against_a_running_server(agent_checkpoint, tmp_path):
    out = tmp_path / "s.json"
    with running_server(agent_checkpoint, {"max_model_len": 512}, scripted=False) as srv:
        assert main(["bench", "--url", f"http://127.0.0.1:{srv.options.port}", "-p", "32", "-n", "8", "-r", "2",
                     "--json", str(out)]) == 0
    rows = _rows(out)
    assert {r["test"] for r in rows} == {"pp32", "tg8", "ttft32"}
    assert all(r["backend"] == "server" and r["model"] == "tiny" and r["median"] > 0 for r in rows)


def test_bench_reports_the_hidden_copy_share_of_streamed_prefill(checkpoint, tmp_path):
    path, _ = checkpoint("qwen3_moe")
    out = tmp_path / "h.json"
    assert main(["bench", "--model", str(path), "-p", "32", "-n", "2", "-r", "2", "--cache-fraction", "1.0",
                 "--stream-min-tokens", "16", "--json", str(out)]) == 0
    hidden = [r for r in _rows(out) if r["test"] == "pp32 copy hidden"]
    assert [r["backend"] for r in hidden] == ["hearth cache 1"]
    assert all(0.0 <= s <= 100.0 for s in hidden[0]["samples"]) and len(hidden[0]["samples"]) == 2
