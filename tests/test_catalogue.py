"""The bad-input catalogue (tests/catalogue_cases.py), run in child processes.

Every case calls a public entry point (or the glue, mhattn._C), and names
it. A child runs the cases in order and prints one JSON line per finished
case; when it dies (a crash) or stalls (a hang), the first case without a
line is the culprit, and the rest run in a new child. So one crash fails
one case, never the suite, and is named.
"""
import json
import os
import subprocess
import sys

import pytest

import mhattn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import catalogue_cases  # noqa: E402

CHILD = os.path.join(HERE, "catalogue_cases.py")
BATCH_TIMEOUT = 300   # seconds for one child; generous for sanitizer builds


def child_env():
    env = dict(os.environ)
    # The child must import the very mhattn this process imported.
    pkg_parent = os.path.dirname(os.path.dirname(mhattn.__file__))
    env["PYTHONPATH"] = os.pathsep.join(
        [pkg_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_in_children(names, child=CHILD):
    """{name: result dict}; crashed or hung cases get a 'died' entry."""
    results, pending = {}, list(names)
    while pending:
        try:
            proc = subprocess.run([sys.executable, child, *pending], env=child_env(),
                                  capture_output=True, text=True, timeout=BATCH_TIMEOUT)
            out, err, how = proc.stdout, proc.stderr, f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            how = f"no answer within {BATCH_TIMEOUT} s (a hang)"
        for line in out.splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and r.get("case") in pending:
                results[r["case"]] = r
        pending = [n for n in pending if n not in results]
        if pending:
            results[pending[0]] = {"case": pending[0], "died": how, "stderr": err[-4000:]}
            pending = pending[1:]
    return results


@pytest.fixture(scope="module")
def results():
    return run_in_children(list(catalogue_cases.CASES))


def check_result(name, expect, r):
    assert "died" not in r, f"{name}: the child process died: {r['died']}\n{r['stderr']}"
    if r.get("skip"):
        pytest.skip(r["skip"])
    # The case called every entry point it names (tests/test_catalogue_coverage.py
    # counts the cases of each by these names).
    missed = set(catalogue_cases.ENTRY[name]) - set(r.get("entered", ()))
    assert not missed, f"{name}: names {sorted(missed)} but never called it"
    if expect == catalogue_cases.OK:
        assert r["exc"] is None, f"{name}: {r['exc']}: {r['msg']}\n{r.get('tb', '')}"
        return
    _, types, words = expect
    assert r["exc"] is not None, f"{name}: no exception was raised"
    assert set(r["mro"]) & set(types), (
        f"{name}: raised {r['exc']}, expected one of {types}: {r['msg']}\n{r['tb']}")
    for w in words:
        assert w in r["msg"], f"{name}: {w!r} not in the message {r['msg']!r}"


@pytest.mark.parametrize("name", list(catalogue_cases.CASES))
def test_catalogue(results, name):
    check_result(name, catalogue_cases.CASES[name][1], results[name])


def test_catalogue_covers_the_issue():
    """The kinds of bad input the issue lists are all in the catalogue."""
    names = " ".join(catalogue_cases.CASES)
    for kind in ["ndim_x_0d", "ndim_x_4d", "disagree_batch_key", "disagree_T_key_vs_value",
                 "list_too_long", "list_string_inside", "none_x", "dtype_x_complex",
                 "dtype_x_object", "dtype_x_bool", "dtype_x_string", "num_heads_zero",
                 "num_heads_negative", "num_heads_float", "num_heads_huge",
                 "size_weights_overflow_size_t", "size_weights_exceed_memory",
                 "mask_not_broadcastable", "mask_int", "key_lengths_float",
                 "scale_string", "causal_int", "disagree_w_o_rows",
                 "valid_negative_strides", "valid_unaligned", "valid_byteswapped",
                 "valid_subclass", "valid_memmap", "valid_nested_lists", "nan_"]:
        assert kind in names, kind


def test_catalogue_covers_the_output_gate():
    """The kinds of hostile gate (issue 38, item 4) are all in the catalogue,
    each bad one on every entry point that takes the gate."""
    names = set(catalogue_cases.CASES)
    joined = " ".join(names)
    for kind in ["w_gate_width", "w_gate_rows", "w_gate_1d", "w_gate_3d", "b_gate_width",
                 "b_gate_2d", "b_gate_without_w_gate", "w_gate_complex", "w_gate_object",
                 "b_gate_complex", "b_gate_object", "w_gate_float16_in_float64_call"]:
        for short, _, _ in catalogue_cases.GATE_ENTRIES:
            assert f"gate_{kind}_{short}" in names, (kind, short)
    for kind in ["gate_half_w_gate_float32_", "gate_half_b_gate_void2_",
                 "gate_float64_gate_promotes_a_float32_call", "gate_valid_negative_strides_",
                 "gate_valid_read_only_", "gate_inputs_are_never_written",
                 "gate_nan_in_one_column_", "gate_infinite_bias_", "gate_infinite_weight_",
                 "gate_zero_query_rows", "gate_zero_input_features", "gate_layer_gate_string",
                 "gate_layer_gate_int_1", "gate_layer_call_w_gate_is_the_layers",
                 "gate_load_state_dict_weight_shape", "glue_gate_wgate_width",
                 "glue_gate_bgate_without_wgate", "glue_gate_float32_call_wgate_float64",
                 "glue_backward_gate_wgate_width", "glue_gate_any_layout", "gate_size_"]:
        assert kind in joined, kind


@pytest.mark.slow
def test_runner_names_a_crash_and_goes_on(tmp_path):
    """The harness itself: a case that kills its process is named as the
    culprit and the cases after it still run (so the runner can fail)."""
    child = tmp_path / "child.py"
    child.write_text(
        "import json, os, sys\n"
        "for n in sys.argv[1:]:\n"
        "    if n == 'boom':\n"
        "        os.abort()\n"
        "    if n == 'stall':\n"
        "        import time; time.sleep(60)\n"
        "    print(json.dumps({'case': n, 'exc': None, 'msg': ''}), flush=True)\n")
    global BATCH_TIMEOUT
    saved, BATCH_TIMEOUT = BATCH_TIMEOUT, 2
    try:
        res = run_in_children(["a", "boom", "b", "stall", "c"], child=str(child))
    finally:
        BATCH_TIMEOUT = saved
    assert res["a"]["exc"] is None and res["b"]["exc"] is None and res["c"]["exc"] is None
    assert "exit status" in res["boom"]["died"]
    assert "hang" in res["stall"]["died"]
