#!/usr/bin/env bash
# One cross-version CI job (issue 38): a new venv on another Python, another torch, PuLP 4, and
# the compatibility subset of the tests (`pytest -m compat`, listed in tests/conftest.py and
# named in the README), plus any extra markers the job asks for.
#
# Usage: bash .ci/compat_job.sh PYTHON_VERSION TORCH_SPEC [--newest-torch] [--extra PIP_SPEC]...
#                               [--markers EXPR]
#   PYTHON_VERSION  a version pyenv has (3.12.1), or a python executable on PATH (python3.13)
#   TORCH_SPEC      what pip installs for torch: "torch==2.11.0", or "torch" with --newest-torch
#   --newest-torch  lift this machine's pip cap on torch (a global `constraint` file) for this
#                   venv alone, so pip takes the newest release PyPI has
#   --extra SPEC    another package to install beside torch (e.g. "lerobot[smolvla,pi]==0.6.1")
#   --markers EXPR  the pytest marker expression (default: compat)
#
# The venv is made anew each run under $DMUON_CI_VENVS (default ~/.cache/dmuon-ci), so a stale
# install cannot hide a missing step; pip's own wheel cache keeps the ~2 GB torch download
# between runs. Prints the job's wall time and pytest's counts; exits with pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=$1 TORCH_SPEC=$2
shift 2
NEWEST=0 EXTRAS=() MARKERS=compat
while [[ $# -gt 0 ]]; do
    case "$1" in
        --newest-torch) NEWEST=1; shift ;;
        --extra) EXTRAS+=("$2"); shift 2 ;;
        --markers) MARKERS=$2; shift 2 ;;
        *) echo "compat_job: unknown argument $1" >&2; exit 2 ;;
    esac
done
start=$SECONDS
if command -v pyenv >/dev/null 2>&1 && pyenv prefix "$PYVER" >/dev/null 2>&1; then
    BASE_PY="$(pyenv prefix "$PYVER")/bin/python"
elif command -v "$PYVER" >/dev/null 2>&1; then
    BASE_PY=$(command -v "$PYVER")
else
    echo "compat_job: no Python $PYVER here (pyenv has: $(pyenv versions --bare 2>/dev/null | tr '\n' ' '))" >&2
    exit 2
fi
VENVS=${DMUON_CI_VENVS:-$HOME/.cache/dmuon-ci}
VENV="$VENVS/py$("$BASE_PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
mkdir -p "$VENVS"
"$BASE_PY" -m venv --clear "$VENV"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ $NEWEST == 1 ]]; then
    # An empty constraints file replaces the machine's (docs/compatibility.md): PIP_CONSTRAINT=
    # (empty) would be ignored and keep the cap.
    NOCAP="$VENVS/no-constraints.txt"
    : > "$NOCAP"
    export PIP_CONSTRAINT=$NOCAP
fi
echo "compat_job: $("$PY" --version) in $VENV: installing $TORCH_SPEC ${EXTRAS[*]:-}"
"$PY" -m pip install -q "$TORCH_SPEC" "${EXTRAS[@]}"
"$PY" -m pip install -q -e ".[test,demo]"
"$PY" - <<'EOF'
import importlib.metadata as md, sys
names = ["torch", "pulp", "numpy", "transformers", "accelerate", "lerobot"]
versions = []
for n in names:
    try:
        versions.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        pass
print("compat_job: Python %d.%d.%d; " % sys.version_info[:3] + ", ".join(versions))
EOF
echo "compat_job: install took $((SECONDS - start)) s; running pytest -m '$MARKERS'"
set +e
OMP_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider -m "$MARKERS" --durations=10
status=$?
set -e
echo "compat_job: Python $PYVER done in $((SECONDS - start)) s, pytest exit $status"
exit $status
