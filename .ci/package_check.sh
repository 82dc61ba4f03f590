#!/usr/bin/env bash
# Release check (issue 33): what a user gets from `pip install dmuon` and from the sdist.
#
#   1. `python -m build` on a `git archive HEAD` export gives a wheel and an sdist, with no
#      deprecation warning; the wheel's METADATA has `License-Expression: Apache-2.0` and both
#      carry LICENSE;
#   2. the unpacked sdist holds the test helpers, docs, bench results and CI scripts, and
#      `pytest --collect-only` passes in it;
#   3. the wheel, installed without extras into a fresh venv with torch==2.13.0, runs the
#      README's `python -m dmuon.profile --model pi0 --nodes 1 --gpus-per-node 8 --out plan.json`
#      (exit 0, plan.json written, no matplotlib needed);
#   4. in that venv (no gym-pusht) `python -m dmuon.train --steps 3` fails with the
#      missing-package message in each of 3 runs, before any other rank's gloo error.
#
# Usage: bash .ci/package_check.sh [--no-venv] [--train-runs N]
#   --no-venv: steps 1-2 only (no torch install); --train-runs N: step 4 runs N times (default 3,
#   0 skips it).
# Needs: git, `pip install build`, network or a local index for the build's setuptools>=77
# and the venv's torch==2.13.0 (pip's cache makes the second install quick). About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV_STEPS=1
TRAIN_RUNS=3
while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-venv) VENV_STEPS=0; shift ;;
        --train-runs) TRAIN_RUNS=$2; shift 2 ;;
        *) echo "usage: bash .ci/package_check.sh [--no-venv] [--train-runs N]" >&2; exit 2 ;;
    esac
done
export PIP_DISABLE_PIP_VERSION_CHECK=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dmuon-package-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { echo "package_check: FAILED: $*" >&2; exit 1; }
step() { echo "package_check: $*"; }

step "1. build wheel and sdist from git archive HEAD ($(git rev-parse --short HEAD))"
mkdir -p "$WORK/src" "$WORK/dist"
git archive --format=tar HEAD | tar -x -C "$WORK/src"
python -m build --outdir "$WORK/dist" "$WORK/src" > "$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log"; fail "python -m build exited non-zero"; }
if grep -i "deprecat" "$WORK/build.log"; then fail "the build printed the deprecation warnings above"; fi
WHEEL=$(ls "$WORK"/dist/dmuon-*.whl)
SDIST=$(ls "$WORK"/dist/dmuon-*.tar.gz)
python - "$WHEEL" <<'EOF' || fail "wheel metadata"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
meta = zipfile.ZipFile(sys.argv[1]).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
assert "License-Expression: Apache-2.0" in meta, "no License-Expression in METADATA"
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE not in the wheel"
assert any(n.endswith("dmuon/kernels/configs/launch_configs.json") for n in names), "launch configs missing"
assert not any(n.startswith(("tests/", "bench/", "docs/")) for n in names), "the wheel holds more than dmuon"
EOF
step "   $(basename "$WHEEL"), $(basename "$SDIST"): no deprecation warning, License-Expression set"

step "2. unpacked sdist: files and pytest --collect-only"
mkdir -p "$WORK/sdist"
tar -xzf "$SDIST" -C "$WORK/sdist"
SD=$(ls -d "$WORK"/sdist/dmuon-*)
for f in LICENSE CHANGELOG.md .ci/run .ci/package_check.sh tests/conftest.py tests/_pool.py \
         tests/models.py tests/dist_cases.py docs/usage.md docs/compatibility.md bench/bench_step.py \
         bench/results/history/README.md; do
    [[ -e "$SD/$f" ]] || fail "the sdist lacks $f"
done
(cd "$SD" && PYTHONPATH="$SD" python -m pytest --collect-only -q -p no:cacheprovider > "$WORK/collect.log" 2>&1) \
    || { tail -40 "$WORK/collect.log"; fail "pytest --collect-only in the unpacked sdist"; }
step "   $(tail -1 "$WORK/collect.log")"

if [[ $VENV_STEPS == 0 ]]; then step "done (--no-venv: steps 3-4 skipped)"; exit 0; fi

step "3. fresh venv, torch==2.13.0 and the wheel without extras: the README's dmuon.profile example"
python -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
env -u PYTHONPATH "$PY" -m pip install -q torch==2.13.0 > "$WORK/pip.log" 2>&1 \
    || { tail -20 "$WORK/pip.log"; fail "pip install torch==2.13.0 in a fresh venv"; }
env -u PYTHONPATH "$PY" -m pip install -q "$WHEEL" >> "$WORK/pip.log" 2>&1 \
    || { tail -20 "$WORK/pip.log"; fail "pip install of the wheel"; }
mkdir -p "$WORK/run"
cd "$WORK/run"  # away from the checkout: the installed wheel is what runs
# A new user's state: no dmuon cache (with ~/.cache/dmuon's PushT dataset from earlier runs,
# dmuon.train needs no simulator and trains instead of reporting it missing).
export DMUON_CACHE="$WORK/cache"
env -u PYTHONPATH OMP_NUM_THREADS=1 "$PY" -c "import dmuon; assert dmuon.__version__, dmuon.__file__; print('   dmuon', dmuon.__version__, 'from', dmuon.__file__)"
if env -u PYTHONPATH "$PY" -c "import matplotlib" 2>/dev/null; then fail "matplotlib is in the venv: not a plain install"; fi
env -u PYTHONPATH OMP_NUM_THREADS=1 "$PY" -m dmuon.profile --model pi0 --nodes 1 --gpus-per-node 8 \
    --out plan.json > profile.log 2>&1 || { tail -20 profile.log; fail "dmuon.profile exited non-zero without matplotlib"; }
[[ -s plan.json ]] || fail "dmuon.profile wrote no plan.json"
step "   exit 0, plan.json written; last line: $(tail -1 profile.log)"

if [[ $TRAIN_RUNS -gt 0 ]]; then
step "4. python -m dmuon.train --steps 3 without gym-pusht: the missing-package message, $TRAIN_RUNS runs"
for i in $(seq "$TRAIN_RUNS"); do
    rc=0
    env -u PYTHONPATH OMP_NUM_THREADS=1 timeout 300 "$PY" -m dmuon.train --steps 3 > "train$i.log" 2>&1 || rc=$?
    [[ $rc != 0 ]] || fail "dmuon.train ran without gym-pusht (run $i)"
    [[ $rc != 124 ]] || { tail -30 "train$i.log"; fail "run $i: dmuon.train still ran after 300 s without gym-pusht"; }
    first_msg=$(grep -n "gym-pusht" "train$i.log" | head -1 | cut -d: -f1 || true)
    first_gloo=$(grep -n -i "connection closed\|gloo" "train$i.log" | head -1 | cut -d: -f1 || true)
    [[ -n "$first_msg" ]] || { tail -30 "train$i.log"; fail "run $i: no missing-package message (gym-pusht)"; }
    [[ -z "$first_gloo" || "$first_msg" -lt "$first_gloo" ]] \
        || { cat "train$i.log"; fail "run $i: another rank's gloo error comes before the missing-package message"; }
done
step "   the missing-package message came first in $TRAIN_RUNS of $TRAIN_RUNS runs"
fi
step "done"
