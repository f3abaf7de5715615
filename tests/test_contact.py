"""The GPU contact check's runner (bench/contact.py), its targets and its guard, on the CPU: each
row in its own process, every check journaled as it ends, a row that hangs killed at its budget
and one that crashes reported, and neither costing the rows after it. The rows themselves run in
the rehearsal (tools/gpu_rehearsal.sh, in .ci/run)."""

from __future__ import annotations

import json

import pytest

from bench import contact
from bench.contact_targets import targets
from bench.gpu_executor import guarded

FAKE = "tests.contact_fake_rows"


def rows(*names: str) -> tuple[contact.Row, ...]:
    return tuple(contact.Row(n, f"the {n} row", 20, 20) for n in names)


def test_rows_run_apart_and_each_check_is_journaled(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(contact, "MIN_ROW_S", 1)
    plan = (contact.Row("fine", "fine", 30, 30), contact.Row("hangs", "hangs", 3, 3),
            contact.Row("crashes", "crashes", 30, 30), contact.Row("skips", "skips", 30, 30))
    report = contact.run_rows(tmp_path, 90, True, None, plan, FAKE)
    checks = {r["check"]: r for r in report["rows"]}
    assert checks["fine one"]["dry"] is True and checks["fine two"]["value"] == 3.5
    assert checks["before the hang"]["ok"] and checks["hangs: killed at its budget"]["ok"] is False
    assert checks["before the crash"]["ok"] and checks["crashes: exited with 3"]["ok"] is False
    # pytest's skip is a BaseException: the guard reports it and the row goes on.
    assert checks["a helper that skips"]["ok"] is False and "Skipped" in checks["a helper that skips"]["error"]
    assert checks["after the skip"]["ok"]
    journal = [json.loads(line) for line in (tmp_path / "contact.jsonl").read_text().splitlines()]
    assert journal == report["rows"] and json.loads((tmp_path / "contact.json").read_text())["rows"] == journal
    assert "== row hangs" in (tmp_path / "contact.log").read_text()


def test_a_row_past_the_budget_is_skipped_not_started(tmp_path) -> None:
    report = contact.run_rows(tmp_path, 5, True, None, rows("fine"), FAKE)  # 5 s left < MIN_ROW_S
    assert [r["check"] for r in report["rows"]] == ["fine: not started"]
    assert report["rows"][0]["ok"] is None


def test_earlier_savings_go_to_a_row_but_later_rows_keep_theirs(tmp_path, monkeypatch) -> None:
    given = []
    monkeypatch.setattr(contact, "run_child", lambda row, out, budget, dry, module: given.append(round(budget))
                        or {"how": "finished", "seconds": 0})
    contact.run_rows(tmp_path, 100, False, None, rows("a", "b", "c"), FAKE)
    assert given == [60, 80, 100]  # nothing used: each may take all but what the later rows need


def test_the_guard_lets_an_interrupt_through() -> None:
    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        guarded("interrupted", interrupted)
    assert guarded("fails", lambda: 1 / 0)["error"].startswith("ZeroDivisionError")


def test_targets_met_missed_and_unknown() -> None:
    shape = "shape decode batch=1 cache={} static={}"
    found = [
        {"check": "exact float32 cache=1.0 static=graph", "ok": True, "static": "graph", "graph_skips": 0,
         "sync_in_replay": None},
        {"check": shape.format("1.0", "off"), "tok_s": 100.0},
        {"check": shape.format("1.0", "graph"), "tok_s": 260.0, "hbm_share": 0.37},
        {"check": shape.format("0.25", "graph"), "qstar_share": 0.7},
        {"check": "elastic VRAM with another process", "ok": True},
    ]
    met = {t["target"]: t["met"] for t in targets(found, dry=False)}
    assert met["fp32 exact against the CPU engine"] and met["graph skips in fixed-shape steps"]
    assert met["host syncs inside a replay"] and met["resizes exact"]
    assert met["graph decode / HBM bound, 30B-A3B shape, batch 1, cache 1.0"]
    assert met["graph / plain decode, batch 1, cache 1.0"]  # 2.6x
    assert met["decode / q* model bound at cache 0.25"] is False
    assert met["16k prefill / PCIe bound"] is None  # no row: unknown, not met
    failed = [{**found[0], "graph_skips": 2}]
    assert {t["target"]: t["met"] for t in targets(failed, False)}["graph skips in fixed-shape steps"] is False
