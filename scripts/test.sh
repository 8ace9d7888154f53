#!/usr/bin/env bash
# Quick start 2: install the test dependencies, then run the test suite (CPU, gloo, 2 processes).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh "[test]"
python -m pytest -q "$@"
