#!/usr/bin/env bash
# The documentation site (issue 37), built as the README tells a user and
# checked:
#   1. pip install '.[docs]' into the Python in force (a venv: .ci/run's);
#   2. sphinx-build -W -b html docs <scratch>/html: every warning fails,
#      with nitpicky cross-references and numpydoc's validation
#      (docs/conf.py); the gallery's examples run during it;
#   3. sphinx-build -W -b doctest: the pages' doctest blocks (the
#      docstrings' examples run in tests/test_docstrings.py);
#   4. tests/test_docs_site.py with MHATTN_DOCS_HTML set: three pages opened
#      in headless Chromium (apt's chromium, installed if missing), a script
#      error, a failed load or a broken <img> fails; screenshots go to
#      <scratch>/shots.
# Usage, from the repository root: bash tools/ci/docs.sh
# Sphinx writes generated pages into docs/ (reference/generated,
# auto_examples), so the build runs on a copy of the tracked files it reads
# (docs, tests, and benchmarks/results for the gallery's benchmark plot).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
start=$SECONDS

(cd "$root" && "$py" -m pip install -q '.[docs]')
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
"$py" -m pip install -q pytest

dir=$(mktemp -d /tmp/mhattn-docs.XXXXXX)
(cd "$root" && git ls-files -z docs tests benchmarks/results | tar --null -T - -cf -) | tar -xf - -C "$dir"
cd "$dir"
# the installed mhattn, not the tree's python/ (which this copy leaves out)
"$py" -c "import mhattn, sys; assert not mhattn.__file__.startswith('$root/python'), mhattn.__file__"

run() {   # run LABEL LOG CMD...
    local label=$1 log=$2 t0=$SECONDS
    shift 2
    if ! "$@" >"$log" 2>&1; then
        tail -60 "$log"
        echo "FAIL: docs: $label"
        exit 1
    fi
    echo "  $label: ok ($((SECONDS - t0)) s)"
}
echo "== docs: in $dir"
run "sphinx-build -W -b html" html.log "$py" -m sphinx -W -b html docs "$dir/html"
run "sphinx-build -W -b doctest" doctest.log "$py" -m sphinx -W -b doctest docs "$dir/doctest"
grep -A3 "^Doctest summary" doctest.log | tail -3
run "headless Chromium on three pages" pages.log env MHATTN_DOCS_HTML="$dir/html" \
    MHATTN_DOCS_SHOTS="$dir/shots" PYTEST_ADDOPTS="" "$py" -m pytest -q -p no:cacheprovider \
    tests/test_docs_site.py
tail -1 pages.log
echo "  pages: $(find "$dir/html" -name '*.html' | wc -l) HTML files; screenshots in $dir/shots"
echo "OK: docs, $((SECONDS - start)) s"
