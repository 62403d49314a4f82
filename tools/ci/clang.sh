#!/usr/bin/env bash
# Build mhattn with clang and test it on every ISA path this CPU runs:
#   1. copy the tracked files into a scratch directory (an installed mhattn
#      and the tree's own in-place build are not touched);
#   2. CC=clang python setup.py build_ext --inplace there; any "warning:" in
#      the build log fails the step;
#   3. the whole pytest suite once, on the best ISA path the CPU has, with
#      the tests that take the `isa` fixture run on every path (scalar up
#      to the best): the clang build's every kernel is held to the
#      reference that way, while .ci/run's gcc build runs the whole suite
#      on each path (running it per path here too cost 12 minutes a path
#      and added no kernel coverage);
#   4. make -C tests/c check CC=clang (the C tests, plain and ASan+UBSan).
# Usage, from the repository root: bash tools/ci/clang.sh
# Takes about 15 minutes on 2 shared cores: the suite plus about a minute
# to build.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
start=$SECONDS

if ! command -v clang >/dev/null; then
    apt-get update -qq && apt-get install -y -qq clang
fi
"$py" -c "import numpy, pytest, setuptools" 2>/dev/null ||
    "$py" -m pip install -q numpy pytest setuptools
echo "== clang: $(clang --version | head -1)"

dir=$(mktemp -d /tmp/mhattn-clang.XXXXXX)
trap 'rm -rf "$dir"' EXIT
(cd "$root" && git ls-files -z | tar --null -T - -cf -) | tar -xf - -C "$dir"

echo "== clang: building in $dir"
if ! (cd "$dir" && CC=clang "$py" setup.py build_ext --inplace >build.log 2>&1); then
    cat "$dir/build.log"
    echo "FAIL: clang build"
    exit 1
fi
if grep "warning:" "$dir/build.log"; then
    echo "FAIL: clang build has warnings"
    exit 1
fi

cd "$dir"
export PYTHONPATH="$dir/python"
unset MHATTN_ISA
"$py" - "$dir" <<'PY'
import sys, mhattn._C as C
assert C.__file__.startswith(sys.argv[1]), C.__file__
PY
best=$("$py" -c "import mhattn; print(mhattn.get_isa())")

summary=""
echo "== clang: pytest on $best, the isa-fixture tests on every path"
t0=$SECONDS
unset MHATTN_TEST_ISAS
if ! "$py" -m pytest -q -p no:cacheprovider tests >pytest.log 2>&1; then
    tail -40 pytest.log
    echo "FAIL: pytest (clang build)"
    exit 1
fi
tail -1 pytest.log
summary+="  pytest on $best: $(tail -1 pytest.log | tr -d '=') ($((SECONDS - t0)) s)"$'\n'

echo "== clang: make -C tests/c check CC=clang"
t0=$SECONDS
if ! make -j2 -C tests/c check CC=clang OUT="$dir/ctest" >ctest.log 2>&1; then
    tail -40 ctest.log
    echo "FAIL: make -C tests/c check CC=clang"
    exit 1
fi
if grep "warning:" ctest.log; then
    echo "FAIL: the C tests' clang build has warnings"
    exit 1
fi
grep -q "^clang " ctest.log || { echo "FAIL: tests/c did not build with clang"; exit 1; }
summary+="  make -C tests/c check CC=clang: ok ($((SECONDS - t0)) s)"$'\n'

echo "== clang: summary (best ISA $best)"
echo "  build: no warnings"
printf "%s" "$summary"
echo "OK: clang, $((SECONDS - start)) s"
