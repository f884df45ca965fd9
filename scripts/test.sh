#!/usr/bin/env bash
# The test command: lint, type check, then the whole test suite (slow cases included) on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
python -m pytest -n 2 --durations=15 "$@"
