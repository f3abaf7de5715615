"""The GPU contact check's rows, each in its own process under its own time budget.

    python3 bench/contact.py --out DIR [--budget-s 430] [--cpu-dry-run] [--rows a b ...]
    python3 bench/contact.py --out DIR --row NAME [--cpu-dry-run]      # one row (what the first runs)

``bench/gpu_contact.sh`` sets up a bare GPU machine and calls the first form. Rows run most
important first (``ROWS``). Each runs in a child process, so that a row that hangs (a ring that
is never answered), crashes, or leaves the GPU in a fault costs only itself: the child is killed at
its budget and the next row starts on a fresh CUDA context. Every check a row makes is appended
to ``DIR/contact.jsonl`` as soon as it is known, and the children's output to ``DIR/contact.log``,
so a run stopped at any point still leaves what ran. At the end ``DIR/contact.json`` gathers the
rows and the acceptance targets (``bench/contact_targets.py``).

``--cpu-dry-run`` runs every row on the CPU (the virtual expert device, small models, fixed-shape
steps eager): the rehearsal CI runs so that the script cannot rot. Its numbers say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # appended: a namespace folder on PYTHONPATH (gpu_contact.sh) must stay first
    sys.path.append(str(ROOT))


@dataclass(frozen=True)
class Row:
    """One row of the check: ``name`` (its function in ``bench/contact_rows.py``), what it shows,
    and its budget in seconds on a GPU and on the dry run."""

    name: str
    what: str
    budget_s: float
    dry_budget_s: float


ROWS = (
    Row("cuda", "a. CUDA facts; the fill, ring and expert kernels against torch", 60, 60),
    Row("exact", "b. the executor in fp32 against the CPU engine, plain and graph; bf16 against GPU eager", 120, 150),
    Row("shape", "c, d. decode and prefill on the Qwen3-30B-A3B shape next to the HBM, q* and PCIe bounds", 170, 120),
    Row("elastic", "e. elastic VRAM: another process takes GPU memory and frees it; tokens exact", 35, 60),
    Row("families", "f. the other families, plain steps, against the CPU engine", 45, 120),
)
MIN_ROW_S = 15  # a row with less time left than this is reported as skipped, not started
ROWS_MODULE = "bench.contact_rows"


def run_rows(out: Path, budget_s: float, dry: bool, names: list[str] | None, rows: tuple[Row, ...] = ROWS,
             rows_module: str = ROWS_MODULE) -> dict:
    """Every row in its own process, in order, within ``budget_s`` in all; returns the report.
    ``rows`` and ``rows_module`` (where each ``row_<name>`` is) are the contact check's own but in
    tests."""
    start = time.time()
    journal, log = out / "contact.jsonl", out / "contact.log"
    chosen = [row for row in rows if not names or row.name in names]
    for i, row in enumerate(chosen):
        left = budget_s - (time.time() - start)
        later = sum(r.dry_budget_s if dry else r.budget_s for r in chosen[i + 1 :])
        # What earlier rows left unused goes to this one, what later rows need stays theirs.
        budget = min(max(row.dry_budget_s if dry else row.budget_s, left - later), left)
        if budget < MIN_ROW_S:
            append(journal, {"row": row.name, "check": f"{row.name}: not started", "ok": None,
                             "skipped": f"{left:.0f} s of the budget left"})
            continue
        say(log, f"== row {row.name} ({row.what}); budget {budget:.0f} s")
        outcome = run_child(row, out, budget, dry, rows_module)
        say(log, f"== row {row.name}: {outcome['how']} after {outcome['seconds']} s")
        if outcome["how"] != "finished":
            append(journal, {"row": row.name, "check": f"{row.name}: {outcome['how']}", "ok": False, **outcome})
    rows = read_journal(journal)
    from bench.contact_targets import targets

    report = {"dry_run": dry, "seconds": round(time.time() - start, 1), "budget_s": budget_s,
              "rows": rows, "targets": targets(rows, dry)}
    (out / "contact.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def run_child(row: Row, out: Path, budget: float, dry: bool, rows_module: str = ROWS_MODULE) -> dict:
    """``--row`` in a new process group, its output appended to the log; killed (the whole group:
    its CPU workers too) at ``budget``."""
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--out", str(out), "--row", row.name,
           "--rows-module", rows_module]
    cmd += ["--cpu-dry-run"] if dry else []
    started = time.time()
    with open(out / "contact.log", "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            code = proc.wait(timeout=budget)
            how = "finished" if code == 0 else f"exited with {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            how, code = "killed at its budget", None
    tail = (out / "contact.log").read_text(errors="replace").splitlines()[-8:] if how != "finished" else []
    return {"how": how, "exit_code": code, "seconds": round(time.time() - started, 1),
            **({"log_tail": tail} if tail else {})}


def append(path: Path, record: dict) -> None:
    """One JSON line, flushed at once (a run killed later keeps it)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def say(path: Path, line: str) -> None:
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def read_journal(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def child(name: str, out: Path, dry: bool, rows_module: str = ROWS_MODULE) -> int:
    """Run one row; each check it makes goes to the journal (and a line to stdout) as it ends."""
    import importlib

    rows = importlib.import_module(rows_module)
    journal = out / "contact.jsonl"

    def record(check: dict) -> None:
        check = {"row": name, **check}
        append(journal, check)
        mark = {True: "ok  ", False: "FAIL", None: "info"}[check.get("ok")]
        detail = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in check.items()
                  if k not in ("row", "check", "ok", "where")}
        print(f"{mark} {check['check']}: {detail}", flush=True)
        if "where" in check:
            print("     " + "\n     ".join(check["where"]), flush=True)

    getattr(rows, f"row_{name}")(rows.Rig(dry=dry), record)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for contact.jsonl, contact.log, contact.json")
    ap.add_argument("--budget-s", type=float, default=430, help="all rows together, in seconds")
    ap.add_argument("--cpu-dry-run", action="store_true", help="every row on the CPU: tests the script, not a GPU")
    ap.add_argument("--rows", nargs="*", help="only these rows (names: " + ", ".join(r.name for r in ROWS) + ")")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # the child's form
    ap.add_argument("--rows-module", default=ROWS_MODULE, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.row:
        return child(args.row, args.out, args.cpu_dry_run, args.rows_module)
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        # Not a pass: on a GPU machine this is a broken driver or torch build.
        print("contact: no CUDA device on this machine (--cpu-dry-run rehearses the rows on the CPU)")
        return 2
    report = run_rows(args.out, args.budget_s, args.cpu_dry_run, args.rows)
    failed = [r["check"] for r in report["rows"] if r.get("ok") is False]
    print("targets:")
    for t in report["targets"]:
        mark = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        print(f"  {mark} {t['target']}: {t['value']} (goal {t['goal']})")
    print(f"{len(report['rows'])} checks in {report['seconds']} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
