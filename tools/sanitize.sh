#!/usr/bin/env bash
# Build mhattn._C with -fsanitize=address,undefined (setup.py's
# MHATTN_SANITIZE=1) in a private copy of the tree, then run the test suite
# against it -- or the command given as arguments, e.g.
#   tools/sanitize.sh python fuzz/fuzz_mha.py -runs=1000
# The normal build (in-place or installed) is not touched.
#
# CPython is not built with ASan, so the runtimes are preloaded; pymalloc is
# turned off so ASan sees every Python allocation; leak detection is off
# because CPython leaks at exit by design (tools/valgrind_smoke.sh looks at
# mhattn's own leaks); allocator_may_return_null lets an impossible malloc
# fail as it does without ASan (the catalogue asks for 16 TiB on purpose);
# any UBSan report stops the run with a stack trace. PyTorch (the oracle
# tests' dependency) imports and runs under the preloaded ASan (checked with
# torch 2.13 CPU), so nothing is skipped for it here.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${MHATTN_SAN_DIR:-$root/build/sanitize}
py=${PYTHON:-python3}
cc=${CC:-gcc}

rm -rf "$dir"
mkdir -p "$dir"
cp -r "$root/setup.py" "$root/pyproject.toml" "$root/README.md" "$root/csrc" \
      "$root/python" "$dir/"
find "$dir/python" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
echo "== sanitize: building mhattn._C with ASan + UBSan in $dir"
if ! (cd "$dir" && MHATTN_SANITIZE=1 "$py" setup.py -q build_ext --inplace \
        >"$dir/build.log" 2>&1); then
    cat "$dir/build.log"
    exit 1
fi

export LD_PRELOAD="$("$cc" -print-file-name=libasan.so) $("$cc" -print-file-name=libubsan.so)"
export PYTHONMALLOC=malloc
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export PYTHONPATH="$dir/python${PYTHONPATH:+:$PYTHONPATH}"

# Make sure the sanitized build is the one imported.
"$py" - "$dir" <<'PY'
import sys, mhattn._C as C
assert C.__file__.startswith(sys.argv[1]), C.__file__
print("== sanitize: testing", C.__file__)
PY
cd "$root"
if [ $# -gt 0 ]; then
    exec "$@"
fi
# --capture=sys: a sanitizer report is written to file descriptor 2 just
# before the process exits; pytest's default fd capture would swallow it.
exec "$py" -m pytest -q -p no:cacheprovider --capture=sys tests
