"""The layout rules of the source (csrc/README.md, shared STYLE.md), held
by a test so that a change that breaks one fails here:

- only the glue, the files under csrc/python/, includes Python or NumPy;
- no glue file is longer than 600 lines, and no glue function longer than 80;
- the kernel table is the only ISA switch: no code outside core/dispatch.c
  (and the glue's name list) compares against an ISA;
- no function in csrc/ is longer than 120 lines (tests/test_structure.py
  holds python/mhattn/ to 100);
- every per-type template names its functions in full (no token pasting
  that hides a name from grep): a function of a template is defined either
  as PICK(name_f32, name_f64) or under a short name that the file binds
  once, `#define name PICK(name_f32, name_f64)`, so that grep finds both
  full names and, from them, the short one.
"""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
func_lengths = pytest.importorskip("func_lengths")

CSRC = os.path.join(ROOT, "csrc")
GLUE = os.path.join(CSRC, "python")
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


def in_glue(path):
    return os.path.dirname(path) == GLUE


def test_only_the_glue_includes_python():
    glue = []
    for path, text in c_sources():
        includes = re.findall(r'#\s*include\s*[<"]([^>"]+)[>"]', text)
        python = [i for i in includes if i.startswith(("Python", "numpy/"))]
        if in_glue(path):
            glue.append(path)
        else:
            assert not python, f"{path} includes {python}"
    # the glue's files include Python through its header
    assert os.path.join(GLUE, "glue.h") in glue and len(glue) > 2
    with open(os.path.join(GLUE, "glue.h"), encoding="utf-8") as fh:
        assert "Python.h" in fh.read()


def test_one_isa_switch():
    allowed = {os.path.join(CSRC, "core", "dispatch.c"), os.path.join(CSRC, "core", "dispatch.h"),
               os.path.join(GLUE, "module.c")}
    for path, text in c_sources():
        if path in allowed:
            continue
        code = code_only(text)
        assert not re.search(r"\bMHA_ISA_(SCALAR|AVX2|AVX512|NEON)\b", code), \
            f"{path} switches on an ISA; ask mha_kernels_for() for the table instead"


def test_no_token_pasted_names():
    for path, text in c_sources():
        if in_glue(path):
            continue
        code = code_only(text)
        assert "##" not in code, f"{path} pastes tokens; name the function in full (PICK)"


# `#define SHORT PICK(a, b)` where a and b are names (PICK of values, such
# as PICK(128, 64), PICK("avx2_f32", "avx2_f64") or PICK(float, double),
# binds no name).
BINDING = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+PICK\(\s*([A-Za-z_]\w*)\s*,"
                     r"\s*([A-Za-z_]\w*)\s*\)[ \t]*$", re.M)


def pick_bindings(text):
    """{short name: (f32 name, f64 name)} of a file's bindings."""
    return {m.group(1): (m.group(2), m.group(3)) for m in BINDING.finditer(code_only(text))
            if m.group(2) not in ("float", "double")}


def is_template(path):
    """A per-type template: included once per element type."""
    return path.endswith(("_impl.h", ".inc")) and not path.endswith("kernels.inc")


def naming_problems(root, sources):
    """What hides a full name in the (path, text) files below root: a binding
    whose two names are not one stem with _f32 and _f64, or whose short name
    (in lower case: a function) is not that stem, or a template's function
    binding left in force past its file; a function of a template defined
    under a name that neither PICK nor a binding of its file writes in
    full."""
    problems, bound = [], {}
    for path, text in sources:
        bound[os.path.relpath(path, root)] = b = pick_bindings(text)
        for short, (f32, f64) in b.items():
            stem = f32[:-4]
            if not (f32.endswith("_f32") and f64 == stem + "_f64"):
                problems.append(f"{path}: {short} binds {f32} and {f64}, not one name's two types")
            elif short != short.upper() and short != stem:
                problems.append(f"{path}: {short} binds {f32}: a function's short name is its stem")
            elif (is_template(path) and short != short.upper()
                  and not re.search(rf"^[ \t]*#[ \t]*undef[ \t]+{short}\b", text, re.M)):
                # left bound, it would rename the next template's or a
                # table's `.name` (kernels_type.inc)
                problems.append(f"{path}: {short} is bound and never unbound")
    for path, line, name, _ in func_lengths.c_functions(root):
        b = bound.get(path, {})
        if is_template(path) and not name.endswith("_f64") and name not in b:
            problems.append(f"{path}:{line}: {name} is defined under no full name "
                            "(PICK(name_f32, name_f64), or a short name bound to it)")
    return problems


def test_templates_name_their_functions_in_full():
    assert naming_problems(ROOT, c_sources()) == []


def test_the_naming_check_checks(tmp_path):
    # It sees the bindings it is meant to check ...
    with open(os.path.join(CSRC, "core", "gemm_impl.h"), encoding="utf-8") as fh:
        assert pick_bindings(fh.read())["gemm_pack_a"] == ("gemm_pack_a_f32", "gemm_pack_a_f64")
    # ... and fails on each way of hiding a name.
    bad = ("#define tile PICK(tile_f32, tiles_f64)\n"
           "#define pack PICK(gemm_pack_f32, gemm_pack_f64)\n"
           "#define kept PICK(kept_f32, kept_f64)\n"
           "static void tile(void)\n{\n}\n"
           "static void helper(void)\n{\n}\n"
           "#undef tile\n#undef pack\n")
    os.makedirs(tmp_path / "csrc")
    path = tmp_path / "csrc" / "bad.inc"
    path.write_text(bad)
    found = naming_problems(str(tmp_path), [(str(path), bad)])
    assert len(found) == 4 and "tiles_f64" in found[0] and "stem" in found[1] \
        and "kept is bound" in found[2] and "helper" in found[3], found


def test_function_lengths():
    long_c = [(p, line, n, k) for p, line, n, k in func_lengths.c_functions(ROOT) if k > 120]
    assert not long_c, f"C functions over 120 lines: {long_c}"


def test_glue_files_are_short():
    # The glue is split by concern (csrc/README.md): no file of it over 600
    # lines.
    long_files = []
    for path, text in c_sources():
        if in_glue(path) and text.count("\n") > 600:
            long_files.append((os.path.relpath(path, ROOT), text.count("\n")))
    assert not long_files, f"glue files over 600 lines: {long_files}"


def test_glue_functions_are_short():
    glue = os.path.relpath(GLUE, ROOT)
    found = [(p, line, n, k) for p, line, n, k in func_lengths.c_functions(ROOT)
             if os.path.dirname(p) == glue]
    assert len(found) > 50, "the counter sees the glue's functions"
    long_glue = [f for f in found if f[3] > 80]
    assert not long_glue, f"glue functions over 80 lines: {long_glue}"


def test_the_length_counter_counts():
    # The counter itself must see the functions it is meant to limit.
    found = {n: k for _, _, n, k in func_lengths.c_functions(ROOT)}
    assert {"mha_check_config", "flash_task", "bwd_mm", "mha_forward_f64"} <= set(found)
    assert all(k > 0 for k in found.values())


def test_the_core_api_takes_at_most_six_parameters():
    """Issue 34: every function of mha.h takes at most 6 parameters (the
    config, the params struct, the error out and a few sizes), so a new
    argument is a field of mha_config or mha_params, never a new parameter;
    and each operation is one function for every element type."""
    with open(os.path.join(CSRC, "mha.h"), encoding="utf-8") as fh:
        text = code_only(fh.read())
    protos = re.findall(r"^[A-Za-z_][\w \*]*?\b(mha_\w+)\s*\(([^;{]*?)\)\s*;", text, re.M)
    names = {name for name, _ in protos}
    assert {"mha_forward", "mha_backward", "mha_attend", "mha_attend_backward", "mha_project",
            "mha_check_config", "mha_pack_weight"} <= names, names
    for name, params in protos:
        count = 0 if params.strip() in ("", "void") else params.count(",") + 1
        assert count <= 6, f"mha.h: {name} takes {count} parameters"
        assert not re.search(r"_f(32|64)$", name), f"mha.h: {name} is one type's entry point"
