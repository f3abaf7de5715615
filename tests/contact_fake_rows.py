"""Rows for tests/test_contact.py: what the contact check's runner must survive."""

from __future__ import annotations

import os
import time

from bench.gpu_executor import Rig, guarded

__all__ = ["Rig", "row_fine", "row_hangs", "row_crashes", "row_skips"]


def row_fine(rig: Rig, record) -> None:
    record({"check": "fine one", "ok": True, "dry": rig.dry})
    record({"check": "fine two", "ok": None, "value": 3.5})


def row_hangs(rig: Rig, record) -> None:
    record({"check": "before the hang", "ok": True})
    time.sleep(600)


def row_crashes(rig: Rig, record) -> None:
    record({"check": "before the crash", "ok": True})
    os._exit(3)  # as a GPU fault ends a process: no exception, no cleanup


def row_skips(rig: Rig, record) -> None:
    import pytest

    record(guarded("a helper that skips", lambda: pytest.importorskip("a_module_that_is_not_there")))
    record({"check": "after the skip", "ok": True})
