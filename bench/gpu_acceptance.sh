#!/usr/bin/env bash
# The first GPU in one command (see bench/gpu_acceptance.py): profile, measured blocks, executor runs beside
# predictions, report + profiles/<gpu>-measured.json.   bash bench/gpu_acceptance.sh [--dry-run --out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/gpu_acceptance.py "$@"
