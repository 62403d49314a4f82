#!/usr/bin/env bash
# Linux aarch64 under qemu-user: cross-compile the C core (csrc/core/*.c,
# csrc/kernels/*.c; not the Python glue) with aarch64-linux-gnu-gcc -O2
# -std=c11 -Wall -Wextra -Werror, then the C tests of tests/c (their
# Makefile's flags, plus -Werror) and tests/c/test_isa_driver.c, and run
# them all under qemu-aarch64. On aarch64 the best path is NEON, so the
# driver checks NEON against the portable path in float32 and float64 and
# that every result has the same bits at 1, 2 and 3 threads; the other tests
# check each path against their references.
#
#   bash tools/ci/aarch64.sh          the driver's whole grid (25 s under
#                                     qemu here), then the C tests in their
#                                     `quick` mode (minutes: qemu emulates
#                                     every FMA in software)
#   MHATTN_ARM_FULL=1 bash ...        the C tests' full grids (much slower)
#   MHATTN_ARM_TESTS="test_qk ..."    these C tests after the driver
#                                     (default: test_qk test_gate
#                                     test_attend test_attend_bwd
#                                     test_variants test_half
#                                     test_kv_storage)
# test_gemm runs its dispatch checks (`env`) only by default: its quick mode
# takes ~19 min under qemu here, and its fork-with-a-live-pool check dies
# inside qemu-user 7.2 itself (assertion in accel/tcg/cpu-exec.c: cpu ==
# current_cpu, the child exits 127); its 26962 other checks passed on the
# scalar and NEON paths (MHATTN_ARM_TESTS=test_gemm runs it).
#
# Installs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user from
# Debian when missing. Exit status non-zero on any build warning or failed
# test. Timings under qemu mean nothing; nothing here runs on ARM hardware.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
start=$(date +%s)

cc=aarch64-linux-gnu-gcc
need=()
command -v "$cc" >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [ ${#need[@]} -gt 0 ]; then
    echo "== aarch64: installing ${need[*]}"
    sudo_=""
    [ "$(id -u)" -eq 0 ] || sudo_=sudo
    $sudo_ apt-get update -qq
    $sudo_ apt-get install -y -qq "${need[@]}"
fi
sysroot=/usr/aarch64-linux-gnu
run() { qemu-aarch64 -L "$sysroot" "$@"; }

out=${MHATTN_ARM_OUT:-$(mktemp -d /tmp/mhattn-aarch64.XXXXXX)}
mkdir -p "$out/obj"
inc=(-Icsrc -Icsrc/core -Icsrc/kernels)

echo "== aarch64: compiling the core with $cc -O2 -std=c11 -Wall -Wextra -Werror"
objs=()
for f in csrc/core/*.c csrc/kernels/*.c; do
    o="$out/obj/$(basename "$f" .c).o"
    "$cc" -O2 -std=c11 -Wall -Wextra -Werror -fvisibility=hidden -pthread "${inc[@]}" \
        -c "$f" -o "$o"
    objs+=("$o")
done
echo "   ${#objs[@]} units"
# The NEON unit must hold the NEON kernels (an empty unit would mean the
# aarch64 guard failed).
nm "$out/obj/isa_neon.o" 2>/dev/null | grep -q mha_kernels_neon_f32 ||
    aarch64-linux-gnu-nm "$out/obj/isa_neon.o" | grep -q mha_kernels_neon_f32 ||
    { echo "isa_neon.o has no NEON table"; exit 1; }

echo "== aarch64: building tests/c (the Makefile's flags, plus -Werror) and the ISA driver"
tests=(test_gemm test_variants test_qk test_gate test_attend test_attend_bwd test_isa_driver
       test_half test_kv_storage)
for t in "${tests[@]}"; do
    "$cc" -std=c11 -O3 -Wall -Wextra -Werror -fvisibility=hidden -pthread "${inc[@]}" \
        -o "$out/$t" "tests/c/$t.c" "${objs[@]}" -lm
done

mode=quick
[ "${MHATTN_ARM_FULL:-0}" = 1 ] && mode=""
echo "== aarch64: running under qemu-aarch64 (C tests: ${mode:-full})"
isa=$(run "$out/test_gemm" env | cut -d' ' -f1)
[ "$isa" = neon ] || { echo "detected ISA is '$isa', expected neon"; exit 1; }
[ "$(MHATTN_ISA=scalar MHATTN_NUM_THREADS=3 run "$out/test_gemm" env)" = "scalar 3" ] ||
    { echo "MHATTN_ISA=scalar does not force the portable path"; exit 1; }
[ "$(MHATTN_ISA=avx2 run "$out/test_gemm" env | cut -d' ' -f1)" = neon ] ||
    { echo "MHATTN_ISA=avx2 (another architecture's name) should leave neon"; exit 1; }
log="$out/log"
: >"$log"
fail=0
ran=1
t0=$(date +%s)
if run "$out/test_isa_driver" >"$out/driver.log" 2>&1; then
    echo "   test_isa_driver ok ($(($(date +%s) - t0)) s): $(tail -n 1 "$out/driver.log")"
else
    echo "   test_isa_driver FAILED"
    cat "$out/driver.log"
    fail=1
fi
for t in ${MHATTN_ARM_TESTS:-test_qk test_gate test_attend test_attend_bwd test_variants
                          test_half test_kv_storage}; do
    t0=$(date +%s)
    ran=$((ran + 1))
    if run "$out/$t" $mode >>"$log" 2>&1; then
        echo "   $t ok ($(($(date +%s) - t0)) s)"
    else
        echo "   $t FAILED"
        fail=1
    fi
done
if [ "$fail" != 0 ]; then
    echo "== aarch64: failures; logs in $out"
    tail -n 40 "$log"
    exit 1
fi
echo "== aarch64: ok: ${#objs[@]} units warning-free, $ran tests passed under qemu-aarch64" \
     "($(($(date +%s) - start)) s)"
[ -n "${MHATTN_ARM_OUT:-}" ] || rm -rf "$out"
