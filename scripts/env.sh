# Sourced by demo.sh, test.sh and floors.sh: a project virtualenv with torch and fsdp-opt installed.
# An already importable torch is kept (CUDA builds included); otherwise TORCH_SPEC is installed.
# Installs go through uv when it can be had (pip installs it into the virtualenv in a few seconds): the same packages
# pip resolves, in about a third of pip's time on a fresh machine. FSDP_OPT_PIP=1 installs with pip instead; so does
# a machine where uv cannot be installed or fails.
VENV="${FSDP_OPT_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# pip's settings that choose packages (its configuration files and PIP_* variables), given to uv, which reads neither;
# and pip's rule for several indexes: the best version any of them has.
uv_settings=(--index-strategy unsafe-best-match)
while IFS= read -r line; do
  key=${line%%=*}
  key=${key#*.}
  value=${line#*=}
  value=${value#\'}
  value=${value%\'}
  case "$key" in
    find-links | constraint | index-url | extra-index-url)
      for v in $value; do uv_settings+=("--$key" "$v"); done
      ;;
  esac
done < <(python -m pip config list 2>/dev/null)

# install ARGS...: pip install's arguments (a requirement, -e ., -r FILE, --no-deps, --target DIR).
install() {
  if [ -z "${FSDP_OPT_PIP:-}" ] && { [ -x "$VENV/bin/uv" ] || python -m pip install -q uv >/dev/null 2>&1; }; then
    # Files copied, not hard-linked from uv's cache: hard-linked, the libraries' pages counted about 90 MiB more in
    # each process's RSS here (torch's import alone 47), against which the host-RAM plan is measured (pip's install).
    if "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --compile-bytecode --link-mode copy \
      "${uv_settings[@]}" "$@"; then
      return
    fi
    echo "uv could not install $*: pip instead" >&2
  fi
  python -m pip install -q "$@"
}

# FSDP_OPT_INSTALLED=1: the virtualenv is installed already (.ci/run's install into .floors beside the suite): only
# activate it and define install(), so no second install of the checkout runs beside the first's check.
if [ -z "${FSDP_OPT_INSTALLED:-}" ]; then
  python -c "import torch" 2>/dev/null || install "${TORCH_SPEC:-torch==2.13.0}"
  install -e ".${1:-}"
fi
