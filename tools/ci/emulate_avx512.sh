#!/usr/bin/env bash
# The AVX-512 kernels on a machine without AVX-512, through the test build
# MHATTN_EMULATE_AVX512=1 (setup.py; csrc/kernels/simd_emu512.h: the same
# kernel templates on plain-C lanes of 16 floats / 8 doubles, which give the
# AVX-512 path's bits):
#   1. copy the tracked files into a scratch directory (an installed mhattn
#      and the tree's own in-place build are not touched);
#   2. build there with MHATTN_EMULATE_AVX512=1; any "warning:" fails;
#   3. check that mhattn._C.EMULATED_AVX512 is 1 and MHATTN_ISA=avx512
#      selects it;
#   4. the golden test (tests/golden/avx512.npz was recorded on AVX-512
#      hardware: the emulation must give its bits, at 1 and 3 threads), then
#      the whole suite with the emulated path in force; both with
#      MHATTN_TEST_ISAS=avx512 (tests/conftest.py), so that the tests run
#      per ISA run on avx512 only: the other paths had the main run;
#   5. the C tests built with -DMHA_EMULATE_AVX512=1 (no sanitizers), in
#      their quick modes, with MHATTN_ISA=avx512: their loops over ISAs run
#      up to harness_best_isa(), the emulated avx512 here.
# Where the CPU has AVX-512, step 4 checks the emulation against the
# recorded bits all the same, and its second run is the files whose tests
# take the `isa` fixture (the whole suite has run on the real avx512
# kernels in .ci/run's main run, so only the emulation is new here).
#
#   bash tools/ci/emulate_avx512.sh               golden test + whole suite
#   MHATTN_EMU_TESTS="tests/test_golden.py" ...   only these test paths
#
# Needs an x86-64 CPU with AVX2 + FMA (the emulation's unit is compiled for
# them); elsewhere it says so and exits 0.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
start=$SECONDS

"$py" -c "import numpy, pytest, setuptools" 2>/dev/null ||
    "$py" -m pip install -q numpy pytest setuptools

dir=$(mktemp -d /tmp/mhattn-emu512.XXXXXX)
trap 'rm -rf "$dir"' EXIT
(cd "$root" && git ls-files -z | tar --null -T - -cf -) | tar -xf - -C "$dir"

echo "== emulated avx512: building in $dir"
if ! (cd "$dir" && MHATTN_EMULATE_AVX512=1 "$py" setup.py build_ext --inplace \
        >build.log 2>&1); then
    cat "$dir/build.log"
    echo "FAIL: MHATTN_EMULATE_AVX512=1 build"
    exit 1
fi
if grep "warning:" "$dir/build.log"; then
    echo "FAIL: MHATTN_EMULATE_AVX512=1 build has warnings"
    exit 1
fi

cd "$dir"
export PYTHONPATH="$dir/python"
unset MHATTN_ISA
"$py" - "$dir" <<'PY'
import sys
import mhattn
import mhattn._C as C
assert C.__file__.startswith(sys.argv[1]), C.__file__
assert C.EMULATED_AVX512 == 1, C.EMULATED_AVX512
PY
got=$(MHATTN_ISA=avx512 "$py" -c "import mhattn; print(mhattn.get_isa())")
if [ "$got" != avx512 ]; then
    echo "emulated avx512: MHATTN_ISA=avx512 gives $got (no AVX2 + FMA here?); skipped"
    exit 0
fi

run() {   # run LABEL PYTEST-ARGS...
    local label=$1 t0=$SECONDS
    shift
    echo "== emulated avx512: $label"
    if ! MHATTN_ISA=avx512 MHATTN_TEST_ISAS=avx512 "$py" -m pytest -q -p no:cacheprovider "$@" \
            >pytest.log 2>&1; then
        tail -40 pytest.log
        echo "FAIL: emulated avx512: $label"
        exit 1
    fi
    echo "  $(tail -1 pytest.log | tr -d '=') ($((SECONDS - t0)) s)"
}
run "golden bits" tests/test_golden.py
if [ -z "${MHATTN_EMU_TESTS:-}" ]; then
    MHATTN_EMU_TESTS=tests
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
        MHATTN_EMU_TESTS=$(grep -lE "def test.*\bisa\b" tests/test_*.py | tr '\n' ' ')
    fi
fi
# shellcheck disable=SC2086
run "pytest $MHATTN_EMU_TESTS" $MHATTN_EMU_TESTS

echo "== emulated avx512: the C tests (-O3, quick modes), MHATTN_ISA=avx512"
t0=$SECONDS
if ! make -j2 -C tests/c all OUT="$dir/ctest" EXTRA_CFLAGS=-DMHA_EMULATE_AVX512=1 \
        >ctest-build.log 2>&1; then
    tail -40 ctest-build.log
    echo "FAIL: emulated avx512: C tests build"
    exit 1
fi
if grep "warning:" ctest-build.log; then
    echo "FAIL: emulated avx512: C tests build has warnings"
    exit 1
fi
got=$(MHATTN_ISA=avx512 "$dir/ctest/test_gemm" env | cut -d' ' -f1)
if [ "$got" != avx512 ]; then
    echo "FAIL: emulated avx512: the C tests' MHATTN_ISA=avx512 gives $got"
    exit 1
fi
for t in "test_gemm quick" test_qk test_variants test_attend test_attend_bwd \
         "test_isa_driver quick" "test_threads quick" "test_half quick"; do
    # shellcheck disable=SC2086
    if ! MHATTN_ISA=avx512 "$dir/ctest/"$t >ctest.log 2>&1; then
        tail -40 ctest.log
        echo "FAIL: emulated avx512: $t"
        exit 1
    fi
    echo "  $t: $(tail -1 ctest.log)"
done
echo "  C tests: $((SECONDS - t0)) s"
echo "== emulated avx512: done in $((SECONDS - start)) s"
