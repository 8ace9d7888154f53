#!/usr/bin/env bash
# Quick start 2: install the test dependencies, then run the test suite (CPU, gloo, 2 processes).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh "[test]"
# Two workers (pytest-xdist), one per core of a small machine (three measured slower: 33:41 against 30:42). The
# expensive module fixtures are built once for both workers (conftest.built_once), not once per worker.
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist worksteal "$@"
