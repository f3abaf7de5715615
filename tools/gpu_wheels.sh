#!/usr/bin/env bash
# Fetch the wheels the GPU machine's image lacks into .whl/ (ignored by git), for a machine that
# reaches no package index: the contact check (bench/gpu_contact.sh) installs them from there with
# `pip install --no-index`. Versions come from constraints.txt, so they are CI's pins.
#
#   bash tools/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12, the GPU image's python3
#
# Only what the engine needs and the image does not hold: gguf (GGUF files; pure Python) and
# llguidance (constrained decoding; one abi3 wheel). Their own needs (numpy, pyyaml, requests,
# tqdm) are in the image. The serving stack (fastapi, pydantic, uvicorn, jsonschema) and Ray are not
# carried: the contact check runs the engine alone, and Ray's wheel alone is past the 64 MiB that a
# copy of the tree plus its wheels may take.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${1:-3.12}"
DEST=.whl
WHEELS=(gguf llguidance)
mkdir -p "$DEST"
specs=()
for name in "${WHEELS[@]}"; do
  pin=$(grep -i "^${name}==" constraints.txt || true)
  [ -n "$pin" ] || { echo "gpu_wheels: $name is not pinned in constraints.txt" >&2; exit 2; }
  specs+=("$pin")
done
platforms=()
for tag in manylinux_2_{17,24,27,28,31,34}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$DEST" "${specs[@]}"
# One version of each: an older wheel left beside a newer pin would stop the whole install.
for name in "${WHEELS[@]}"; do
  keep=$(grep -i "^${name}==" constraints.txt | cut -d= -f3)
  for whl in "$DEST"/"${name}"-*.whl; do
    [[ "$(basename "$whl")" == "${name}-${keep}-"* ]] || rm -f "$whl"
  done
done
du -sh "$DEST"
ls "$DEST"
