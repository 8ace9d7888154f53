#!/usr/bin/env bash
# Quick start 1: install, then train tiny-opt on python-docs with 2 CPU processes, end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
python -m fsdp_opt.demo "$@"
