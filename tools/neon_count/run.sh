#!/usr/bin/env bash
# Instruction counts of one core call, portable path vs NEON, under qemu-aarch64
# (README "Platforms": NEON is counted, not timed). From the repository root:
#   bash tools/neon_count/run.sh            # gemm, fwd, bwd, decode; f32 and f64
# insncount.c is a minimal qemu TCG plugin (an inline add per translated
# block); count.c runs one call `reps` times; each figure is the count with
# reps = 1 minus the count with reps = 0 (the set-up alone), at 1 thread.
# loops.py reads an aarch64 objdump and prints each inner loop's FMAs and
# loaded bytes:  aarch64-linux-gnu-objdump -d isa_neon.o > d.txt;
#                python3 tools/neon_count/loops.py d.txt flash_scores_f32 ...
# Needs gcc, gcc-aarch64-linux-gnu and qemu-user (qemu 7.2 with -plugin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$(mktemp -d /tmp/mhattn-neon-count.XXXXXX)
trap 'rm -rf "$out"' EXIT
gcc -O2 -shared -fPIC -o "$out/libinsncount.so" "$here/insncount.c"
inc="-I$root/csrc -I$root/csrc/core -I$root/csrc/kernels"
aarch64-linux-gnu-gcc -O2 -std=c11 -ffp-contract=off $inc -o "$out/count" "$here/count.c" \
    "$root"/csrc/core/*.c "$root"/csrc/kernels/*.c -lm -pthread
count() {   # count ISA OP F64 REPS -> the plugin's total
    MHATTN_ISA=$1 MHATTN_NUM_THREADS=1 qemu-aarch64 -L /usr/aarch64-linux-gnu \
        -plugin "$out/libinsncount.so" -d plugin "$out/count" "$2" "$3" "$4" 2>&1 >/dev/null |
        grep -Eo '[0-9]+' | tail -n 1
}
printf '%-7s %-4s %14s %14s %7s\n' call type portable neon ratio
for op in gemm fwd bwd decode; do
    for f64 in 0 1; do
        s=$(( $(count scalar $op $f64 1) - $(count scalar $op $f64 0) ))
        n=$(( $(count neon $op $f64 1) - $(count neon $op $f64 0) ))
        printf '%-7s %-4s %14d %14d %6.2fx\n' $op "$([ $f64 = 1 ] && echo f64 || echo f32)" \
            $s $n "$(echo "$s / $n" | bc -l)"
    done
done
