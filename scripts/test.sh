#!/usr/bin/env bash
# Quick start 2: install the test dependencies, then run the test suite (CPU, gloo, 2 processes).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh "[test]"
# Two workers (pytest-xdist): most tests wait on subprocesses, so two at a time fill both cores of a small machine.
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist worksteal "$@"
