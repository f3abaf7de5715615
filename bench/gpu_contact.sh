#!/usr/bin/env bash
# The GPU contact check: from a bare copy of the tree on a GPU machine with no package index, set
# hearth up and run the contact rows (bench/contact.py), each under its own budget, writing what
# each found as it goes. One command, about 8 minutes on an H200 (compiles included).
#
#   bash bench/gpu_contact.sh [OUT_DIR]
#
# OUT_DIR: where contact.jsonl (a JSON line per check), contact.log, contact.json (the rows and the
# targets) and setup.json go; else $HEARTH_CONTACT_OUT, else $OUT, else bench/out/contact.
# Environment: PYTHON (default python3), HEARTH_CONTACT_DEADLINE_S (set-up and rows together, default 560 s; the rows get what
# set-up left), HEARTH_CONTACT_BUDGET_S (the rows' budget, instead),
# HEARTH_CONTACT_DRY_RUN=1 (every row on the CPU: the rehearsal CI runs), HEARTH_CONTACT_ROWS (a
# space-separated subset of the rows).
#
# Set-up, none of it through a registry:
# 1. the wheels the machine lacks, from .whl/ (fetched beforehand by tools/gpu_wheels.sh), with
#    `pip install --no-index --no-deps` into a scratch folder;
# 2. `hearth` importable without pip: a scratch folder holds the namespace as pyproject maps it
#    (hearth/ with engine, serving, cli, cluster, proto linked in), first on PYTHONPATH;
# 3. the native CPU kernels built in place with the machine's compiler (tools/build_kernels.py),
#    or the torch paths, said so in setup.json.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
# An absolute path (not resolved through links: a virtual environment's python is one).
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
OUT_DIR="${1:-${HEARTH_CONTACT_OUT:-${OUT:-$REPO/bench/out/contact}}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/hearth-contact.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
note() { echo "contact: $*" | tee -a "$OUT_DIR/contact.log"; }

# 1. Wheels.
wheels="none"
if compgen -G ".whl/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      .whl/*.whl >>"$OUT_DIR/contact.log" 2>&1; then
    wheels="$(cd .whl && ls *.whl | tr '\n' ' ')"
  else
    wheels="failed (see contact.log)"
  fi
fi
note "wheels: $wheels"

# 2. The namespace, as pyproject's package-dir maps it.
mkdir -p "$WORK/src/hearth"
for f in hearth/*.py; do ln -s "$REPO/$f" "$WORK/src/hearth/"; done
for room in engine serving cli cluster proto; do ln -s "$REPO/$room" "$WORK/src/hearth/$room"; done
export PYTHONPATH="$WORK/src:$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
# Nothing before PYTHONPATH on the path: a script's folder or the working directory (`python -m`,
# the CPU worker processes) would put the checkout's own hearth/ folder first.
export PYTHONSAFEPATH=1
# (From the scratch folder: `python -c` puts the working directory first on the path, and the
# repository's own hearth/ folder holds only the package's top.)
if ! (cd "$WORK" && "$PY" -c "import hearth.engine") >>"$OUT_DIR/contact.log" 2>&1; then
  note "hearth.engine does not import (see contact.log)"
  exit 1
fi

# 3. The native CPU kernels, in place.
kernels="$("$PY" tools/build_kernels.py 2>>"$OUT_DIR/contact.log" || echo '{"built": [], "skipped": "build failed"}')"
note "kernels: $kernels"
"$PY" - "$OUT_DIR/setup.json" "$wheels" "$kernels" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
out, wheels, kernels, seconds = sys.argv[1:]
json.dump({"wheels": wheels, "kernels": json.loads(kernels), "setup_seconds": int(seconds)}, open(out, "w"))
EOF

# 4. The rows.
# The rows get what is left of the deadline (default 560 s, inside a 10-minute call) after set-up.
budget="${HEARTH_CONTACT_BUDGET_S:-$(( ${HEARTH_CONTACT_DEADLINE_S:-560} - ($(date +%s) - START) ))}"
args=(--out "$OUT_DIR" --budget-s "$budget")
[ "${HEARTH_CONTACT_DRY_RUN:-0}" = 1 ] && args+=(--cpu-dry-run)
# shellcheck disable=SC2206 - the subset is a space-separated list of names
[ -n "${HEARTH_CONTACT_ROWS:-}" ] && args+=(--rows ${HEARTH_CONTACT_ROWS})
"$PY" -u bench/contact.py "${args[@]}"
code=$?
note "done in $(( $(date +%s) - START )) s (exit $code)"
exit $code
