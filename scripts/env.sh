# Sourced by demo.sh and test.sh: a project virtualenv with torch and fsdp-opt installed.
# An already importable torch is kept (CUDA builds included); otherwise TORCH_SPEC is installed.
VENV="${FSDP_OPT_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e ".${1:-}"
