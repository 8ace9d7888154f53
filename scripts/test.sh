#!/usr/bin/env bash
# Quick start 2: install the test dependencies, then run the test suite (CPU, gloo, 2 processes).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh "[test]"
# Two workers (pytest-xdist), one per core of a small machine (three measured slower: 33:41 against 30:42). Tests that
# share an expensive fixture run on one worker (loadgroup; conftest marks them), so the fixture runs once.
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
