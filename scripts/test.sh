#!/usr/bin/env bash
# Quick start 2: install the test dependencies, then run the test suite (CPU, gloo, 2 processes).
#   bash scripts/test.sh            the gate (what CI runs): every test but the long tier's
#   bash scripts/test.sh --all      everything, the long tier too (run it before a change lands)
#   bash scripts/test.sh --quick    the quick tier: unit tests and one end-to-end run per concern
#   bash scripts/test.sh [--all|--quick] ARGS   any pytest arguments besides (a folder, -k ...)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh "[test]"
tier=(-m "not long")
case "${1:-}" in
  --quick)
    shift
    tier=(-m quick)
    ;;
  --all)
    shift
    tier=()
    ;;
esac
# Inductor's kernel cache is built for one CPU capability: a suite run under another (ATEN_CPU_CAPABILITY exported,
# as .ci/run's second pass does) gets a cache of its own, or the kernels cached under the machine's own fail to build.
if [ -n "${ATEN_CPU_CAPABILITY:-}" ] && [ -z "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
  export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/fsdp-opt-inductor-${ATEN_CPU_CAPABILITY}-$(id -u)"
fi
# The project's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on this project's CI machine) each of
# the suite's few hundred processes would otherwise compile the package again (about 0.4 s of CPU each).
python -m compileall -q -j 0 fsdp_opt benchmarks tests fsdp_finetune.py >/dev/null
# Two workers (pytest-xdist), one per core of a small machine (three measured slower: 33:41 against 30:42). The
# expensive module fixtures are built once for both workers (conftest.built_once), not once per worker; the ranks of
# most runs are forked from a process that has imported the package (tests/launcher.py).
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist worksteal "${tier[@]}" "$@"
