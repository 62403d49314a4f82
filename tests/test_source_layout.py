"""The layout rules of the source (csrc/README.md, shared STYLE.md), held
by a test so that a change that breaks one fails here:

- only the glue, csrc/mhattn_module.c, includes Python or NumPy;
- the kernel table is the only ISA switch: no code outside core/dispatch.c
  (and the glue's name list) compares against an ISA;
- no function in csrc/ is longer than 120 lines (tests/test_structure.py
  holds python/mhattn/ to 100);
- every per-type template names its functions in full (no token pasting
  that hides a name from grep).
"""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
func_lengths = pytest.importorskip("func_lengths")

CSRC = os.path.join(ROOT, "csrc")
GLUE = os.path.join(CSRC, "mhattn_module.c")
if not os.path.isdir(CSRC):
    pytest.skip("no csrc/ here (an installed copy of the tests)", allow_module_level=True)


def c_sources():
    for dirpath, _, files in os.walk(CSRC):
        for f in sorted(files):
            if f.endswith((".c", ".h", ".inc")):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    yield path, fh.read()


def code_only(text):
    """C text without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_only_the_glue_includes_python():
    for path, text in c_sources():
        includes = re.findall(r'#\s*include\s*[<"]([^>"]+)[>"]', text)
        python = [i for i in includes if i.startswith(("Python", "numpy/"))]
        if path != GLUE:
            assert not python, f"{path} includes {python}"
    with open(GLUE, encoding="utf-8") as fh:
        assert "Python.h" in fh.read()


def test_one_isa_switch():
    allowed = {os.path.join(CSRC, "core", "dispatch.c"), os.path.join(CSRC, "core", "dispatch.h"),
               GLUE}
    for path, text in c_sources():
        if path in allowed:
            continue
        code = code_only(text)
        assert not re.search(r"\bMHA_ISA_(SCALAR|AVX2|AVX512|NEON)\b", code), \
            f"{path} switches on an ISA; ask mha_kernels_for() for the table instead"


def test_no_token_pasted_names():
    for path, text in c_sources():
        if path == GLUE:
            continue
        code = code_only(text)
        assert "##" not in code, f"{path} pastes tokens; name the function in full (PICK)"


def test_function_lengths():
    long_c = [(p, line, n, k) for p, line, n, k in func_lengths.c_functions(ROOT) if k > 120]
    assert not long_c, f"C functions over 120 lines: {long_c}"


def test_the_length_counter_counts():
    # The counter itself must see the functions it is meant to limit.
    found = {n: k for _, _, n, k in func_lengths.c_functions(ROOT)}
    assert {"mha_check_config", "flash_task", "bwd_mm", "mha_forward_f64"} <= set(found)
    assert all(k > 0 for k in found.values())
