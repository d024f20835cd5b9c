#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs the package with its test tools.
# Usage: bash scripts/setup.sh            (PYTHON=/path/to/python3.12 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for candidate in "${PYTHON:-}" python3.12 python3.13 python3 python; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local p; p="$(pyenv which python 2>/dev/null || true)"   # honours .python-version
    if [ -n "$p" ] && "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
      echo "$p"; return 0
    fi
  fi
  return 1
}

py="$(find_python)" || {
  echo "error: megatron-core 0.19 needs Python >= 3.12; none found. Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
  exit 1
}
echo "using $("$py" --version) at $py"
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
.venv/bin/python -c "import megatron_mtraining, torch; print('megatron-mtraining', megatron_mtraining.__version__, 'torch', torch.__version__)"
