#!/usr/bin/env bash
# Quick start 2: install the test dependencies, then run the test suite (CPU, gloo, 2 processes).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh "[test]"
# Three workers (pytest-xdist): most tests wait on subprocesses (launches, sleeps, timeouts), so three at a time keep
# both cores of a small machine busy; two left a third of the CPU idle.
python -m pytest -q -n "${PYTEST_WORKERS:-3}" --dist worksteal "$@"
