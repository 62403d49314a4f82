"""Smoke test of benchmarks/mhbench: the pure parts of the benchmark scripts
(parsing, FLOP counts, interleaving and medians, derived figures and
targets, tables, JSON) on tiny inputs.  Nothing here is timed: where a call
runs, only the structure of what comes back is checked."""
import argparse
import importlib.util
import io
import json
import os
import re
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

from mhbench import backward, configs, figures, memory, report, tables, timing  # noqa: E402
from mhbench.peak import Peak  # noqa: E402


def test_parse_config_and_cases():
    assert configs.parse_config("1024x512x8") == (1024, 512, 8)
    assert configs.parse_config("3X4X2") == (3, 4, 2)
    for bad in ("1024x512", "axbxc", "4x6x4", "0x4x2"):
        with pytest.raises(argparse.ArgumentTypeError):
            configs.parse_config(bad)
    assert configs.config_name((3, 4, 2)) == "3x4x2"
    # B = 8 is added after B = 1 for the short configurations only.
    assert configs.build_cases([(3, 4, 2), (1024, 512, 8)]) == [
        (3, 4, 2, 1), (3, 4, 2, configs.SHORT_BATCH), (1024, 512, 8, 1)]


def test_case_flops():
    full = configs.Case(T=4, d=8, h=2, B=3, dtype="float32", causal=False)
    causal = configs.Case(T=4, d=8, h=2, B=3, dtype="float32", causal=True)
    assert full.flops() == 3 * (8 * 4 * 8 * 8 + 4 * 4 * 4 * 8)
    assert causal.flops() == 3 * (8 * 4 * 8 * 8 + 2 * 4 * 4 * 8)
    assert full.label == "4x8x2 B=3 float32 causal=False"


def test_time_interleaved_rounds_and_settle(monkeypatch):
    calls, sleeps = [], []
    monkeypatch.setattr(timing.time, "sleep", sleeps.append)
    a = timing.Timed(lambda: calls.append("a"), min_repeats=1, repeats=10)
    b = timing.Timed(lambda: calls.append("b"), min_repeats=1, repeats=3)
    timing.time_interleaved([a, b], rounds=5, settle_s=0.25)
    assert len(a.samples) == 10 and len(b.samples) == 3
    # Slices of ceil(remaining / rounds left): a 2,2,2,2,2; b 1,1,1,0,0.
    assert "".join(calls) == "aab" * 3 + "aa" * 2
    # A pause at each switch of variant, none between two slices of one.
    assert sleeps == [0.25] * 6


def test_timed_start_and_median():
    out = []
    t = timing.Timed(lambda: out.append(1) or 42, min_repeats=7)
    assert t.start(budget=0.0) == 42
    assert t.repeats == 7 and t.samples == []        # a warm-up is no sample
    once = timing.Timed(lambda: 5, min_repeats=1, warmup=False)
    once.start(budget=0.0)
    assert len(once.samples) == 1                    # the first call counts
    t.samples = [3.0, 1.0, 2.0, 100.0, 4.0]
    assert t.median_s == 3.0
    assert len(timing.sample_times(lambda: None, 4)) == 4
    t.run(3)                                         # wall and CPU time of each call
    assert len(t.samples) == 8 and len(t.cpu_samples) == 3
    burn = timing.Timed(lambda: sum(range(200_000)), min_repeats=3)
    burn.run(3)
    assert burn.median_cpu_s > 0 and burn.median_s > 0


def _row(T=1024, dtype="float32", causal=False, B=1, d=512, h=8, **ms):
    case = configs.Case(T, d, h, B, dtype, causal)
    return dict(T=T, d_model=d, h=h, B=B, dtype=dtype, causal=causal, flops=case.flops(),
                results={k: {"ms": v} for k, v in ms.items()})


def test_derive_and_targets():
    peak = Peak(threads=2, single={"float32": 100.0}, multi={"float32": 150.0})
    assert peak.total("float32") == 200.0 and peak.total("float64") is None
    row = _row(mhattn=100.0, mhattn_packed=80.0, numpy=400.0, torch_mha=300.0,
               torch_sdpa=120.0, ort_mha=110.0, ort_attn=95.0, jax=130.0)
    figures.derive(row, peak)
    assert row["gflops"] == pytest.approx(row["flops"] / 0.1 / 1e9)
    assert row["pct_peak"] == pytest.approx(100 * row["gflops"] / 200.0)
    assert row["packed_pct_peak"] == pytest.approx(row["pct_peak"] * 100 / 80)
    assert row["vs_numpy"] == 4.0
    assert row["torch_best"] == "torch_sdpa" and row["vs_torch"] == pytest.approx(1.2)
    # The best peer is ORT's fastest graph; NumPy is no peer.
    assert (row["torch_ms"], row["torch_variant"]) == (120.0, "torch_sdpa")
    assert (row["ORT_ms"], row["ORT_variant"]) == (95.0, "ort_attn")
    assert row["best_peer"] == "ORT" and row["vs_best_peer"] == pytest.approx(0.95)
    assert row["packed_vs_best_peer"] == pytest.approx(95 / 80)
    assert tables.vs_best_cell("vs_best_peer")(row) == "0.95x ORT"
    assert tables.peer_ms("ORT")(row) == "95 Attn" and tables.peer_ms("JAX")(row) == "130"
    # issue 41's targets: the packed call against every peer, the unpacked
    # one against the peers that take weights per call (torch, JAX)
    assert (row["weights_peer"], row["vs_weights_peer"]) == ("torch", pytest.approx(1.2))
    assert row["unpacked_over_packed"] == pytest.approx(1.25)
    by_what = {t.what: t.status for t in row["targets"]}
    assert by_what == {"packed vs best peer": "PASS", "packed % peak": "MISS",
                       "vs torch/JAX (torch)": "PASS", "unpacked / packed": "MISS"}
    assert tables.target_cell(row) == "MISS packed % peak,unpacked / packed"
    # T = 128: the packed call's targets; without pack_weights they are n/a.
    short = _row(T=128, mhattn=2.0, torch_mha=2.5, jax=3.0)
    short["results"]["mhattn_packed"] = {"skipped": "this build has no mhattn.pack_weights"}
    figures.derive(short, peak)
    assert short["best_peer"] == "torch" and "packed_vs_best_peer" not in short
    assert [(t.what, t.goal, t.status) for t in short["targets"]] == [
        ("packed vs best peer", 1.0, "n/a"), ("vs torch/JAX (torch)", 1.0, "PASS")]
    assert tables.result_ms("mhattn_packed")(short) == "-"
    assert tables.vs_best_cell("packed_vs_best_peer")(short) == "-"
    causal = _row(T=4096, causal=True, mhattn=100.0, mhattn_packed=99.0, ort_attn23=120.0,
                  jax=90.0)
    figures.derive(causal, peak)
    assert [(t.what, t.goal, t.status) for t in causal["targets"]] == [
        ("packed vs best peer", 1.25, "MISS"), ("vs torch/JAX (JAX)", 1.0, "MISS"),
        ("unpacked / packed", 1.1, "PASS")]
    # "at most": equal to the goal passes
    assert figures.Target("x", 1.1, 1.1, "x", op="<=").status == "PASS"
    assert figures.Target("x", 1.1000001, 1.1, "x", op="<=").status == "MISS"
    assert figures.Target("x", 10.0, 10, "x", op="<").status == "MISS"
    assert figures.Target("x", 1.0, 1.0, "x").status == "PASS"            # ">=" by default
    assert "(target <= 1.1x)" in figures.Target("x", 1.0, 1.1, "x", op="<=").text()
    with pytest.raises(ValueError, match="op must be one of"):
        figures.Target("x", 1.0, 1.0, "x", op="=>")
    small = _row(T=3, d=4, h=2, mhattn=0.005)
    figures.derive(small, None)
    assert small["pct_peak"] is None and "best_peer" not in small
    assert [(t.what, t.status) for t in small["targets"]] == [("call", "PASS")]
    assert tables.target_cell(small) == "PASS"
    assert tables.peer_ms("ORT")(small) == "n/a"
    assert figures.count_statuses([row, small], [{"target": "MISS"}]) == {
        "PASS": 3, "MISS": 3, "n/a": 0}


def test_forward_table_structure():
    rows = [_row(mhattn=1.0, numpy=4.0), _row(T=3, d=4, h=2, mhattn=0.005)]
    rows[1]["results"]["numpy"] = {"skipped": "too big"}
    for r in rows:
        figures.derive(r, None)
    full = [c.header for c in tables.forward_columns(with_torch=True, with_ref=True)]
    bare = [c.header for c in tables.forward_columns(False, False, False, False)]
    assert full[:7] == ["T", "d_model", "h", "B", "causal", "mhattn ms", "packed ms"]
    assert full[7:11] == ["torch ms", "ORT ms", "JAX ms", "numpy ms"]
    assert {"vs best peer", "packed vs best", "% peak"} <= set(full)
    assert bare[-2:] == ["max err", "target"] and "numpy ms" not in bare
    assert not {"torch ms", "ORT ms", "JAX ms"} & set(bare)
    buf = io.StringIO()
    tables.print_table("Title", tables.forward_columns(False, True, False, False), rows,
                       file=buf)
    lines = buf.getvalue().splitlines()
    assert lines[:2] == ["", "Title"]
    assert lines[2].split()[:2] == ["T", "d_model"]
    assert set(lines[3]) == {"-"} and len(lines[3]) == len(lines[2])
    assert len(lines) == 4 + len(rows)
    assert "skipped" in lines[5] and lines[5].endswith("PASS")   # the 5 us call
    assert tables.fmt_ms(None) == "n/a" and tables.fmt_ms(1234.5) == "1234"
    assert tables.fmt_ratio(2.5) == "2.50x" and tables.fmt_ratio(123.0) == "123x"
    assert tables.row_summary(rows[1]).startswith("      -> mhattn 0.005 ms, numpy skipped")


def _tiny_data(dtype="float32", B=2, T=5, d=16, h=4):
    """x (T, d) when B == 1 (the unbatched call), else (B, T, d)."""
    from mhbench import variants
    return variants.make_data(T, d, h, B, dtype, np.random.default_rng(1), with_torch=False)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_ort_graphs_agree_with_mhattn(causal):
    """Each of the three ONNX graphs, weights as initializers, computes
    mhattn's layer at a tiny size, batched and not; float64 is skipped."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from mhbench import peers_ort, rows, variants
    from onnx import numpy_helper

    graphs, notes = peers_ort.supported_graphs(threads=1)
    assert set(graphs) | {"attn23"} == set(peers_ort.GRAPHS)
    for B in (1, 2):
        data = _tiny_data(B=B)
        case = configs.Case(5, 16, 4, B, "float32", causal)
        want = variants.mhattn_forward(data, case)()
        for g in graphs:
            model = peers_ort.build_model(g, data.w_q, data.w_k, data.w_v, data.w_o, 4, B, 5,
                                          causal)
            names = {i.name for i in model.graph.initializer}
            assert "W_o" in names and not {i.name for i in model.graph.input} & names
            w_o = [numpy_helper.to_array(i) for i in model.graph.initializer
                   if i.name == "W_o"][0]
            assert np.array_equal(w_o, data.w_o)
            got = peers_ort.make_variant(g, 1).prepare(data, case)()
            assert got.shape == data.x.shape
            assert rows.rel_err(got, want) < 1e-5, g
        # A graph computing something else fails the row's check.
        wrong = peers_ort.layer(graphs[0], data, not causal, 1)()
        assert rows.rel_err(wrong, want) > 1e-3
    with pytest.raises(variants.Unsupported, match="float32"):
        peers_ort.make_variant("mha", 1).prepare(
            _tiny_data("float64"), configs.Case(5, 16, 4, 2, "float64", causal))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_jax_layer_agrees_with_mhattn(causal):
    """The jitted JAX layer computes mhattn's at a tiny size, float32 and
    float64, batched and not."""
    pytest.importorskip("jax")
    from mhbench import peers_jax, rows, variants

    assert peers_jax.available() is not None
    for dtype, tol in (("float32", 1e-5), ("float64", 1e-12)):
        for B in (1, 2):
            data = _tiny_data(dtype, B=B)
            case = configs.Case(5, 16, 4, B, dtype, causal)
            want = variants.mhattn_forward(data, case)()
            got = np.asarray(peers_jax.JAX.prepare(data, case)())
            assert got.shape == want.shape and got.dtype == want.dtype
            assert rows.rel_err(got, want) < tol


def test_packed_variant(monkeypatch):
    """mhattn packed packs once, in prepare, and the timed call passes
    (x, packed, causal=); it is the same layer as the unpacked call, and is
    skipped ("-" in the table) in a build without pack_weights."""
    import mhattn
    from mhbench import variants

    data = _tiny_data()
    case = configs.Case(5, 16, 4, 2, "float32", True)
    want = variants.mhattn_forward(data, case)()
    if hasattr(mhattn, "pack_weights"):
        got = variants.MHATTN_PACKED.prepare(data, case)()
        assert np.array_equal(got, want)
        monkeypatch.delattr(mhattn, "pack_weights")
    with pytest.raises(variants.Unsupported, match="pack_weights"):
        variants.MHATTN_PACKED.prepare(data, case)
    # The plumbing, with a stand-in pack_weights that counts its calls.
    packs, real = [], mhattn.multi_head_attention

    def pack_weights(w_q, w_k, w_v, w_o, *, num_heads):
        packs.append(num_heads)
        return ("packed", w_q, w_k, w_v, w_o, num_heads)

    def mha(x, packed, **kw):
        return real(x, *packed[1:5], num_heads=packed[5], **kw)
    monkeypatch.setattr(mhattn, "pack_weights", pack_weights, raising=False)
    monkeypatch.setattr(mhattn, "multi_head_attention", mha)
    call = variants.MHATTN_PACKED.prepare(data, case)
    assert packs == [4]
    for _ in range(3):
        assert np.array_equal(call(), want)
    assert packs == [4]


def test_memory_text_and_target():
    done = {"mib": 300.4, "call_s": 2.0, "method": "VmHWM after clear_refs"}
    assert memory.memory_text(done) == ("300 MiB beyond the inputs, call 2.0 s"
                                        "  [VmHWM after clear_refs]")
    assert figures.memory_status(done) == "PASS"
    stopped = {"mib": 100.0, "timed_out_after_s": 5.0, "method": "sampled VmRSS"}
    assert memory.memory_text(stopped).startswith(">= 100 MiB")
    assert figures.memory_status(stopped) == "n/a"       # a lower bound below the goal
    assert figures.memory_status(dict(stopped, mib=900.0)) == "MISS"
    assert memory.memory_text({"error": "boom"}) == "error: boom"


def test_write_json(tmp_path):
    row = _row(mhattn=1.0)
    figures.derive(row, None)
    path = str(tmp_path / "out.json")
    report.write_json(path, {"argv": ["x"]}, None, [row], [], ["a note"], partial=True)
    got = json.load(open(path))
    assert list(got) == ["argv", "partial", "peak", "rows", "memory", "notes"]
    assert got["peak"] is None and got["notes"] == ["a note"]
    assert [t["what"] for t in got["rows"][0]["targets"]] == [
        "packed vs best peer", "packed % peak", "vs torch/JAX", "unpacked / packed"]
    assert got["rows"][0]["targets"][0]["status"] == "n/a"


def test_backward_targets_and_table(capsys):
    speedup, targets = backward.row_targets(1024, {"fwd": 1.0, "bwd": 2.0, "mha": 6.0,
                                                   "sdpa": 4.0}, np.float32)
    assert speedup == pytest.approx(4.0 / 3.0)
    assert targets == [("bwd<=2.5fwd", True), ("f+b>=1.5x torch", False)]
    _, targets = backward.row_targets(128, {"fwd": 1.0, "bwd": 3.0}, np.float64)
    assert targets == [("bwd<=2.5fwd", False)]
    backward.print_table([(1024, 64, 2, {"fwd": (1e-3, 2e-3), "bwd": (2e-3, 3e-3)})], 1,
                         np.float32)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["T", "x", "d", "x"] and set(lines[1]) == {"-"}
    assert lines[2].split()[:4] == ["1024x64x2", "2.0", "3.0", "1.50x"]


def _args(**kw):
    base = dict(min_repeats=1, budget=0.0, settle=0.0, ref_max_seconds=60.0, ref_max_gib=8.0)
    return argparse.Namespace(**dict(base, **kw))


def test_measure_row_checks_agreement():
    from mhbench import rows, variants
    from mhbench.refmodel import RefModel

    case = configs.Case(3, 4, 2, 1, "float64", False)
    data = variants.make_data(3, 4, 2, 1, "float64", np.random.default_rng(0), with_torch=False)
    model = RefModel({"float64": 1.0}, {"float64": 1e-9})
    notes = []
    row = rows.measure_row(case, data, [variants.MHATTN, variants.REFERENCE], _args(),
                           model, notes)
    assert list(row["results"]) == ["mhattn", "numpy"] and notes == []
    assert row["results"]["numpy"]["max_rel_err"] <= rows.TOLERANCE["float64"]
    assert row["results"]["mhattn"]["repeats"] >= 1
    # A reference estimated past the limits is skipped, not run.
    row = rows.measure_row(case, data, [variants.MHATTN, variants.REFERENCE],
                           _args(ref_max_seconds=0.0), model, notes)
    assert "skipped" in row["results"]["numpy"] and "ms" not in row["results"]["numpy"]
    wrong = variants.Variant("wrong", "wrong", lambda d, c: lambda: np.zeros((3, 4)))
    with pytest.raises(AssertionError, match="disagrees with mhattn"):
        rows.measure_row(case, data, [variants.MHATTN, wrong], _args(), None, notes)


def test_variants_table_structure():
    """mhbench/models.py on tiny sizes: every pair is checked and timed, the
    table prints, and a ratio is compared with its target."""
    from mhbench import models
    rng = np.random.default_rng(0)
    pairs = models.pairs(rng, T_long=64, T=32, packs=2, T_pack=16)
    assert [p.target for p in pairs] == [0.5] + [1.25] * 5 + [1.2]
    rows = models.measure(pairs, min_repeats=1, budget=0.0, settle=0.0)
    assert len(rows) == len(pairs)
    for r in rows:
        assert r["ms"] > 0 and r["base_ms"] > 0
        assert r["ok"] == (r["ratio"] <= r["target"])
    buf = io.StringIO()
    tables.print_table("t", models.COLUMNS, rows, file=buf)
    assert "causal + window=(255, 0)" in buf.getvalue()


@pytest.mark.parametrize("settle", [0.0, 1e-3])
def test_bench_decode_rotation_and_stream_step(settle):
    """bench_decode.time_row rotates the libraries round by round and times
    the ALONE ones (JAX) in a block after them; after a pause (settle > 0)
    a variant is called once untimed before its timed call; stream_step
    reads its own buffer on every thread and says how many times."""
    import concurrent.futures
    import bench_decode

    order = []
    fns = {n: (lambda n=n: order.append(n)) for n in ("mhattn", "torch", "jax", "ort")}
    times = bench_decode.time_row(fns, (), rounds=3, settle=settle)
    assert set(times) == set(fns) and all(len(v) == 3 and min(v) >= 0
                                          for v in times.values())
    calls_each = 2 if settle > 0 else 1
    timed = order[len(fns):][::calls_each]         # after one warm-up each
    assert order[len(fns):len(fns) + 9 * calls_each] == [
        n for n in timed[:9] for _ in range(calls_each)]
    assert timed[:9] == ["mhattn", "torch", "ort", "torch", "ort", "mhattn",
                         "ort", "mhattn", "torch"]
    assert order[len(fns) + 9 * calls_each:] == ["jax"] * 3

    calls = []

    class Lib:
        def stream_read(self, ptr, n, reps):
            calls.append((ptr, n, reps))
            return 0.0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = bench_decode.stream_step(Lib(), 1 << 20, pool, threads=2)
        assert step(None, None, None) == 64       # 1 MiB read 64 times: 64 MiB
    ptrs = sorted(c[0] for c in calls)
    assert len(calls) == 2 and ptrs[1] - ptrs[0] == (1 << 20) // 2
    assert all(c[1] == (1 << 20) // 8 and c[2] == 64 for c in calls)


def test_bench_decode_paired_share():
    """% bw is the median of the rounds' own ratios: a round in which the
    machine is slow for both calls does not count against mhattn, as it
    would in a ratio of the medians."""
    import bench_decode
    times = {"mhattn": [1.0, 2.0, 4.0, 1.0, 1.0], "stream": [0.9, 1.8, 3.6, 0.9, 0.9]}
    assert bench_decode.paired_share(times, "mhattn", "stream") == pytest.approx(0.9)
    # each stream call read its buffer 2 times: half the share
    assert bench_decode.paired_share(times, "mhattn", "stream", 0.5) == pytest.approx(0.45)
    times["stream"][1:3] = [0.5, 0.5]         # two rounds of a fast stream
    assert bench_decode.paired_share(times, "mhattn", "stream") == pytest.approx(0.9)
    assert bench_decode.medians(times) == {"mhattn": 1.0, "stream": 0.9}


def test_backward_measure_interleaves_and_checks(monkeypatch):
    """backward.measure takes every call's samples in interleaved slices
    (fwd, bwd, then torch's two), `repeats` of each after one warm-up, and
    checks mhattn's gradients against torch's."""
    from mhbench import backward
    order = []
    real = backward.time_interleaved

    def spy(timed, **kw):
        for t in timed:
            fn = t.fn
            t.fn = lambda fn=fn, t=t: order.append(t) or fn()
        real(timed, rounds=3, settle_s=0.0)
    monkeypatch.setattr(backward, "time_interleaved", spy)
    torch = pytest.importorskip("torch")
    row = backward.measure(16, np.float32, 3, True, torch, d_model=16, heads=2)
    assert set(row) == {"fwd", "bwd", "mha", "sdpa"}
    assert all(w > 0 and c >= 0 for w, c in row.values())
    # 3 rounds of one call each, in the same order every round
    assert len(order) == 12 and order[:4] == order[4:8] == order[8:]


def test_bench_ab_parsing_and_summary():
    import bench_ab
    assert bench_ab.parse_case("layer:128x512x8") == ("layer", (128, 512, 8))
    assert bench_ab.parse_case("attn:4096X8x64") == ("attn", (4096, 8, 64))
    assert bench_ab.parse_case("step:4096x512x8") == ("step", (4096, 512, 8))
    assert bench_ab.parse_case("decode:4096x32x8x64") == ("decode", (4096, 32, 8, 64))
    for bad in ("layer:128x512", "conv:1x2x3", "attn:0x8x64", "128x512x8",
                "decode:4096x32x8", "decode:4096x32x6x64", "attn:1x2x3x4"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_ab.parse_case(bad)
    # the timed processes get the case's options back, and nothing else
    args = argparse.Namespace(case=("layer", (8, 16, 2)), batch=3, dtype="f64", budget=0.25,
                              seed=7, stat="min", threads=1, causal=True, packed=False,
                              backward=True)
    assert bench_ab.child_argv(args) == [
        "--case", "layer:8x16x2", "--batch", "3", "--dtype", "f64", "--budget", "0.25",
        "--seed", "7", "--stat", "min", "--threads", "1", "--causal", "--backward"]
    # medians of the round medians, ratios to the first build (> 1: faster)
    rows = bench_ab.summarize(["a", "b"], [
        [{"ms": 2.0, "gflops": 1.0}, {"ms": 4.0, "gflops": 0.5}, {"ms": 3.0, "gflops": 0.7}],
        [{"ms": 1.5, "gflops": 2.0}, {"ms": 1.0, "gflops": 3.0}, {"ms": 9.0, "gflops": 0.1}]])
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("a", 3.0, 1.0, 0.7), ("b", 1.5, 2.0, 2.0)]
    assert rows[1][4] == [1.5, 1.0, 9.0]
    # --stat min: the fastest round of each, and its rate
    rows = bench_ab.summarize(["a", "b"], [
        [{"ms": 2.0, "gflops": 1.0}, {"ms": 4.0, "gflops": 0.5}],
        [{"ms": 1.5, "gflops": 2.0}, {"ms": 0.5, "gflops": 4.0}]], stat="min")
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("a", 2.0, 1.0, 1.0), ("b", 0.5, 4.0, 4.0)]


@pytest.mark.slow
def test_bench_ab_runs_a_build(capsys):
    """Two rounds of the mhattn these tests import against itself, on a tiny
    case: the table names both and every round; a folder without mhattn is
    refused."""
    import bench_ab
    import mhattn
    build = os.path.dirname(os.path.dirname(os.path.abspath(mhattn.__file__)))
    bench_ab.main(["--case", "layer:16x8x2", "--rounds", "2", "--budget", "0.02", "--batch", "2",
                   "--packed", build, build])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("layer 16x8x2 B=2 f32 packed; ISA ")
    assert len(out) == 4 and all(len(line.split()) == 6 for line in out[2:])
    bench_ab.main(["--case", "attn:16x2x8", "--rounds", "2", "--budget", "0.02", "--stat", "min",
                   "--threads", "1", build])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("attn 16x2x8 B=1 f32; ISA ") and out[0].endswith("; 1 threads")
    assert "fastest ms" in out[1] and len(out) == 3 and len(out[2].split()) == 6
    # the cached decode step, packed, on a batch of two caches
    bench_ab.main(["--case", "step:32x8x2", "--rounds", "1", "--budget", "0.02", "--batch", "2",
                   "--packed", build])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 32x8x2 B=2 f32 packed; ISA ") and len(out) == 3
    with pytest.raises(SystemExit):   # a decode step is causal and has no backward here
        bench_ab.main(["--case", "step:32x8x2", "--backward", build])
    # the attention-only decode step, 4 query heads over 2 kv heads
    bench_ab.main(["--case", "decode:64x4x2x8", "--rounds", "1", "--budget", "0.02", build])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("decode 64x4x2x8 B=1 f32; ISA ") and len(out) == 3
    with pytest.raises(SystemExit):
        bench_ab.main(["--case", "decode:64x4x2x8", "--packed", build])
    with pytest.raises(SystemExit, match=r"no mhattn in|No module named 'mhattn'"):
        bench_ab.main(["--rounds", "1", "--budget", "0.02", BENCH])


def _cells(line):
    """A table line's cells: print_table puts two spaces or more between them."""
    return re.split(r"\s{2,}", line.strip())


def test_half_precision_quick_table(capsys):
    """benchmarks/half_precision.py --quick: the machine lines, the prefill
    table (2 sizes x causal or not, every column filled or n/a) and the decode
    section (its table, or the line saying this build has no half/int8
    caches).  Nothing is timed here: only the shape of what is printed."""
    import half_precision as hp
    rows, decode = hp.main(["--quick", "--repeats", "1", "--rounds", "1", "--budget", "0"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mhattn ") and f"ISA {__import__('mhattn').get_isa()}" in out[0]
    flags = out[2].split()
    assert flags[0] == "flags:" and [f.split("=")[0] for f in flags[1:]] == list(hp.FLAGS)
    start = next(i for i, line in enumerate(out) if line.startswith("prefill: "))
    header = _cells(out[start + 1])
    assert header == [c.header for c in hp.PREFILL_COLUMNS] and len(header) == 14
    assert set(out[start + 2]) == {"-"}
    body = out[start + 3:start + 3 + 4]
    assert [tuple(_cells(b)[:2]) for b in body] == [("16", "no"), ("16", "yes"),
                                                   ("64", "no"), ("64", "yes")]
    for b in body:
        cells = _cells(b)
        assert len(cells) == 14, b
        assert all(float(cells[i]) > 0 for i in (2, 3, 5))        # mhattn's three ms
        assert cells[-1] in ("PASS", "n/a") or cells[-1].startswith("MISS ")
    for r in rows:
        ms = r["ms"]
        assert r["bfloat16/f32"] == pytest.approx(ms["mhattn bfloat16"] / ms["mhattn float32"])
    if decode is None:
        assert any(line.startswith("decode: half/int8 KV caches not available in this build")
                   for line in out)
    else:
        start = next(i for i, line in enumerate(out) if line.startswith("decode: one cached"))
        assert len(out[start + 3:start + 5]) == 2 and len(decode) == 2


def test_panels_quick_table(capsys):
    """benchmarks/panels.py --quick: bfloat16 and float32 weight panels
    through the library's micro-kernel give the same bits (panels.c exits 1
    otherwise, which fails the run) on every x86 path this CPU has, and
    the table has a row per (isa, size)."""
    if not __import__("shutil").which(os.environ.get("CC", "cc")):
        pytest.skip("no C compiler")
    import panels
    rows = panels.main(["--quick", "--repeats", "1"])
    if rows is None:
        pytest.skip("needs AVX2 + FMA")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + len(rows) and len(rows) in (2, 4)
    assert all(r[5] > 0 and r[6] > 0 for r in rows)


def test_half_precision_targets_and_decode_rows(capsys):
    """The targets of a prefill row, and the decode table's code on the one
    cache dtype every build has (float32), at a tiny size."""
    import half_precision as hp
    row = dict(ms={"mhattn float32": 10.0, "mhattn bfloat16": 10.5, "mhattn float16": 12.0,
                   "torch float32 MHA": 90.0, "torch float32 SDPA": 80.0,
                   "torch bfloat16 SDPA": 60.0, "torch float16 MHA": 50.0})
    hp.derive(row)
    assert row["torch float32"] == (80.0, "SDPA") and row["vs torch float32"] == 8.0
    assert row["bfloat16/f32"] == pytest.approx(1.05) and row["float16/f32"] == 1.2
    assert row["misses"] == ["f16/f32", "vs torch f16"]   # 60/10.5 >= 5 passes, 50/12 < 5 misses
    assert hp._verdict(row) == "MISS f16/f32,vs torch f16"
    args = hp.parse(["--quick", "--repeats", "1", "--rounds", "1", "--budget", "0"])
    args.decode_tk = 32
    rows = hp.run_decode(["float32"], args)
    out = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and [(r["H"], r["G"]) for r in rows] == [(8, 8), (32, 8)]
    # bytes read: the held rows (G * (d_k + d_v) * 4 each) plus the weights
    w = 4 * (64 * 8 * 64 * 2 + 64 * 8 * 64 * 2)
    assert rows[0]["bytes"]["float32"] == 32 * 8 * 128 * 4 + w
    assert any(line.startswith("decode: one cached layer step") for line in out)


@pytest.mark.parametrize("script,args,rows", [
    ("bench_structured.py", ["--T", "200", "--chunk", "48", "--docs", "5", "--block", "16",
                             "--rounds", "1", "--budget", "0.01"],
     ["causal", "causal, chunk=48", "causal, chunk=48 as a dense mask", "no mask",
      "5 documents as a BlockMask", "5 documents as a dense mask"]),
    ("bench_structured.py", ["--T", "100", "--docs", "3", "--block", "16", "--rounds", "1",
                             "--budget", "0.01", "--layer", "--heads", "2", "--dk", "8"],
     ["causal", "no mask", "3 documents as a BlockMask"]),
    ("bench_dropout.py", ["--T", "64", "--rounds", "1", "--budget", "0.01"], ["False", "True"]),
    ("bench_paged.py", ["--seqs", "5", "--min-len", "3", "--max-len", "300", "--page-sizes",
                        "1,7,128", "--rounds", "1", "--budget", "0.01"],
     ["KVCache", "paged, page_size=1", "paged, page_size=7", "paged core call, page_size=128"]),
    ("bench_paged.py", ["--seqs", "3", "--max-len", "100", "--dtype", "int8", "--rounds", "1",
                        "--budget", "0.01"], ["KVCache", "paged, page_size=16"]),
    pytest.param("bench_dask.py", ["--T", "300", "--chunk", "128", "--heads", "2", "--dk", "16"],
                 ["one call", "dask", "worker 1", "worker 2"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                          reason="mhattn.dask's extra is not installed")),
    ("bench_dropout.py", ["--T", "64", "--rounds", "1", "--budget", "0.01", "--t5"],
     ["False", "True"]),
])
def test_ratio_scripts_print_their_tables(script, args, rows):
    """The scripts that print a ratio table run end to end on a tiny case:
    every row, each with a finite ratio."""
    import subprocess

    import mhattn
    # The mhattn this process imported (the installed one, or a built
    # checkout's under PYTHONPATH), not whatever else sys.path holds: a
    # source tree's python/ without its extension would shadow it.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(mhattn.__file__)))
    res = subprocess.run([sys.executable, os.path.join(BENCH, script), *args],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("| ")]
    for row in rows:
        hits = [ln for ln in lines if ln.split(" | ")[0] == f"| {row}"]
        assert hits, (row, res.stdout)
        for ln in hits:
            last = "structured" in script or "paged" in script
            ratio = float(ln.strip("| ").split(" | ")[-1 if last else 3])
            assert np.isfinite(ratio) and ratio > 0, ln
