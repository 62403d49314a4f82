#!/usr/bin/env bash
# memcheck on a smoke run of mhattn (tools/valgrind_smoke.py: ~50 calls,
# successes and every kind of failure). Fails when an error's stack -- an
# invalid access, a use of uninitialised memory, or a definitely/possibly
# lost block -- has a frame in mhattn._C or csrc/. The interpreter's and
# NumPy's own reports are counted but not held against us.
# Uses the mhattn that `python` imports (set PYTHONPATH for an in-place
# build); PYTHONMALLOC=malloc so that Python's allocations are visible.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
# valgrind must run the interpreter itself, not a launcher script (pyenv).
exe=$("$py" -c 'import sys; print(sys.executable)')
so=$("$py" -c 'import mhattn._C as C; print(C.__file__)')
report=$(mktemp -d)/memcheck.xml
echo "== valgrind: memcheck on tools/valgrind_smoke.py against $so"
status=0
PYTHONMALLOC=malloc valgrind --tool=memcheck --leak-check=full \
    --show-leak-kinds=definite,possible --errors-for-leak-kinds=definite,possible \
    --num-callers=40 --xml=yes --xml-file="$report" \
    "$exe" "$root/tools/valgrind_smoke.py" || status=$?
if [ "$status" -ne 0 ]; then
    echo "valgrind: the smoke run itself failed (exit status $status)"
    exit 1
fi
"$py" "$root/tools/valgrind_filter.py" "$report" "$so"
