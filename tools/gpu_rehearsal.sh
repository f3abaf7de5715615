#!/usr/bin/env bash
# Rehearse the GPU contact check here, on a machine without a GPU, so that it cannot rot between
# the rare sessions that are lent a GPU. Run by .ci/run.
#
#   bash tools/gpu_rehearsal.sh [OUT_DIR]
#
# 1. An environment like the GPU machine's (tools/gpu_image.txt: torch 2.11.0, triton 3.6.0,
#    transformers 5.17.0, ...) in .venv-gpu, without hearth installed in it.
# 2. The wheels that machine lacks, fetched into .whl/ (tools/gpu_wheels.sh), and the size check:
#    the tree that travels plus the wheels must stay within 64 MiB.
# 3. bench/gpu_contact.sh as it runs there (wheels installed with --no-index, hearth importable
#    without pip, kernels built in place), its rows on the CPU (HEARTH_CONTACT_DRY_RUN=1), within
#    a time budget; then every row must be there and none may have failed.
# 4. bench/gpu_check.py's CPU dry run (tests/test_gpu_check.py's slow test), with the checkout's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-$(mktemp -d /tmp/hearth-rehearsal.XXXXXX)}"
VENV="$PWD/.venv-gpu"
LIMIT_MIB=64
BUDGET_S="${HEARTH_REHEARSAL_BUDGET_S:-600}"

if [ ! -f "$VENV/.image" ] || ! cmp -s tools/gpu_image.txt "$VENV/.image"; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # The image's torch is a CUDA build; PyPI's is too, and it runs on a CPU-only machine.
  PIP_CONSTRAINT="" "$VENV/bin/pip" install -q -r tools/gpu_image.txt
  cp tools/gpu_image.txt "$VENV/.image"
fi
"$VENV/bin/python" -c "import torch, transformers, triton; print('rehearsal env: torch', torch.__version__,
  'transformers', transformers.__version__, 'triton', triton.__version__)"
if (cd / && "$VENV/bin/python" -c "import hearth" 2>/dev/null); then  # from /: not the checkout's own folder
  echo "rehearsal: hearth must not be installed in $VENV (the GPU machine has no install)" >&2
  exit 1
fi

bash tools/gpu_wheels.sh "$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" \
  >/dev/null
tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
wheel_bytes=$(du -cb .whl | tail -1 | cut -f1)
total_mib=$(( (tree_bytes + wheel_bytes) / 1048576 ))
echo "rehearsal: tree $(( tree_bytes / 1048576 )) MiB + wheels $(( wheel_bytes / 1048576 )) MiB = $total_mib MiB"
if [ "$total_mib" -ge "$LIMIT_MIB" ]; then
  echo "rehearsal: the tree and its wheels are past the GPU machine's $LIMIT_MIB MiB" >&2
  exit 1
fi

start=$(date +%s)
PYTHON="$VENV/bin/python" HEARTH_CONTACT_DRY_RUN=1 HEARTH_CONTACT_BUDGET_S="$BUDGET_S" \
  timeout $(( BUDGET_S + 120 )) bash bench/gpu_contact.sh "$OUT_DIR"
echo "rehearsal: the contact check ran in $(( $(date +%s) - start )) s"
"$VENV/bin/python" - "$OUT_DIR/contact.json" <<'PYEOF'
import json, sys
from pathlib import Path

sys.path.insert(0, ".")
from bench.contact import ROWS

report = json.loads(Path(sys.argv[1]).read_text())
seen = {r["row"] for r in report["rows"]}
missing = [r.name for r in ROWS if r.name not in seen]
failed = [r["check"] for r in report["rows"] if r.get("ok") is False]
print(f"rehearsal: {len(report['rows'])} checks, rows missing: {missing or 'none'}, failed: {failed or 'none'}")
sys.exit(1 if missing or failed else 0)
PYEOF

# bench/gpu_check.py, the device's longer check, in its CPU dry run: every section must still run
# (a slow test, kept out of the default suite for its two minutes; .ci/run gets here after make test).
if [ -x .venv/bin/python ]; then
  .venv/bin/python -m pytest -q -m slow -p no:cacheprovider "tests/test_gpu_check.py::test_every_section_runs_on_the_cpu"
else
  echo "rehearsal: no .venv (make venv): bench/gpu_check.py's dry run skipped"
fi
