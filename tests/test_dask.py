"""mhattn.dask (issue 40): exact attention over Dask arrays.

Held to one mhattn.attention (attention_grad) call on the whole arrays:
float32 to 1e-6 and float64 to 1e-12 relative (the merge's exp and log add
a few roundings per level of its tree), over chunkings that do not divide T,
T_q != T_k, GQA, causal and window with chunk boundaries on and off the
diagonal, key_lengths that end inside a chunk or empty whole chunks, sinks.
The graph holds only the blocks some query sees (counted), the bits are the
same on every run and scheduler, bad input fails before any task runs, and
a few small tests run on a LocalCluster of two processes (marked
``cluster``), one of which is killed mid-compute.
"""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
import dask  # noqa: E402

import mhattn  # noqa: E402
import mhattn.dask as md  # noqa: E402
from conftest import child_env  # noqa: E402

TOL = {np.float32: 1e-6, np.float64: 1e-12}


def _arrays(rng, B, H, G, Tq, Tk, d=16, dtype=np.float64):
    return (rng.standard_normal((B, H, Tq, d)).astype(dtype),
            rng.standard_normal((B, G, Tk, d)).astype(dtype),
            rng.standard_normal((B, G, Tk, d)).astype(dtype))


def _close(got, want, dtype):
    """Relative to the largest magnitude of want (lse may hold -inf rows)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got))
    assert np.array_equal(got[~fin], want[~fin])
    scale = max(np.max(np.abs(want[fin]), initial=0.0), 1e-30)
    err = np.max(np.abs(got[fin].astype(np.float64) - want[fin]), initial=0.0) / scale
    assert err <= TOL[dtype], err


def _sync(*a):
    return dask.compute(*a, scheduler="sync")


def _count(arr, what="mhattn-attention-"):
    """The block tasks of a mhattn.dask graph: the forward's, or with
    ``what="mhattn-attention-grad-"`` the backward's."""
    return sum(1 for key in dict(arr.__dask_graph__()) if isinstance(key, tuple)
               and isinstance(key[0], str) and key[0].startswith(what)
               and (what.endswith("grad-") or "-grad-" not in key[0])
               and key[0].endswith("-block") and len(key) == 5)


def _key_mask(B, Tk, seed):
    """A padding pattern with holes, a row with no real key, and (for B > 1)
    a row whose real keys all sit in its last quarter."""
    m = np.random.default_rng(seed).random((B, Tk)) < 0.6
    m[0, : Tk // 3] = False
    if B > 1:
        m[1] = False
        m[-1, : 3 * Tk // 4] = False
    return m


CASES = [  # (B, H, G, Tq, Tk, q chunks, k chunks, keywords)
    (2, 4, 4, 100, 100, (1, 2, 30, 16), (2, 4, 30, 16), dict(causal=True)),   # on the diagonal
    (2, 4, 4, 100, 100, (1, 2, 30, 16), (2, 4, 40, 16), dict(causal=True)),   # off it
    (1, 4, 2, 70, 130, (1, 4, 25, 16), (1, 1, 33, 16), dict(causal=True)),    # GQA, Tq < Tk
    (2, 4, 2, 130, 70, (2, 2, 45, 16), (1, 2, 24, 16), dict(causal=True)),    # Tq > Tk
    (1, 2, 2, 90, 90, (1, 1, 20, 16), (1, 2, 20, 16), dict(window=(17, 5))),
    (1, 2, 2, 90, 90, (1, 2, 32, 16), (1, 2, 27, 16), dict(causal=True, window=(30, None))),
    (3, 2, 2, 60, 80, (1, 2, 25, 16), (3, 2, 30, 16), dict(key_lengths=np.array([45, 0, 80]))),
    (2, 2, 1, 60, 90, (1, 2, 20, 16), (2, 1, 30, 16),
     dict(causal=True, key_lengths=np.array([10, 75]), sinks=np.array([0.5, -1.0]))),
    (1, 4, 4, 64, 64, (1, 4, 16, 16), (1, 4, 16, 16),
     dict(causal=True, sinks=np.linspace(-1, 1, 4), alibi_slopes=np.array([.5, .25, .1, .05]),
          softcap=4.0, scale=0.3)),
    (1, 2, 2, 50, 50, (1, 2, 50, 16), (1, 2, 50, 16), {}),                      # one block
    (3, 2, 2, 60, 80, (1, 2, 25, 16), (3, 2, 30, 16), dict(key_mask=_key_mask(3, 80, 1))),
    (3, 4, 2, 70, 70, (2, 2, 20, 16), (3, 2, 24, 16),
     dict(causal=True, key_mask=_key_mask(3, 70, 2), sinks=np.array([0.5, -1.0, 0., 2.]))),
    (1, 2, 2, 60, 60, (1, 2, 25, 16), (1, 2, 25, 16),
     dict(window=(20, 3), key_mask=_key_mask(1, 60, 3)[0])),                  # (T_k,)
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_attention_equals_one_call(rng, case, dtype):
    B, H, G, Tq, Tk, qc, kc, kw = case
    q, k, v = _arrays(rng, B, H, G, Tq, Tk, dtype=dtype)
    out, lse = md.attention(da.from_array(q, chunks=qc), da.from_array(k, chunks=kc),
                            da.from_array(v, chunks=kc), return_lse=True, **kw)
    want_out, want_lse = mhattn.attention(q, k, v, return_lse=True, **kw)
    got_out, got_lse = _sync(out, lse)
    _close(got_out, want_out, dtype)
    _close(got_lse, want_lse, dtype)
    assert out.chunks[2] == da.from_array(q, chunks=qc).chunks[2]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_one_call(rng, case, dtype):
    B, H, G, Tq, Tk, qc, kc, kw = case
    q, k, v = _arrays(rng, B, H, G, Tq, Tk, dtype=dtype)
    g = rng.standard_normal(q.shape).astype(dtype)
    dq, dk, dv = (da.from_array(a, chunks=c) for a, c in ((q, qc), (k, kc), (v, kc)))
    out, lse = md.attention(dq, dk, dv, return_lse=True, **kw)
    res = md.attention_grad(da.from_array(g, chunks=qc), dq, dk, dv, out, lse, **kw)
    want = mhattn.attention_grad(g, q, k, v, **kw)
    (got,) = _sync(res)
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name], dtype)


def test_float16_blocks_merge_in_float32(rng):
    """Half inputs: each block's out is float16 and its lse float32, as
    mhattn.attention's; the merge rounds each level's out to float16, so
    the result is within a few float16 roundings of the one call's."""
    q, k, v = _arrays(rng, 1, 2, 2, 90, 90, dtype=np.float16)
    out, lse = md.attention(*(da.from_array(a, chunks=(1, 2, 25, 16)) for a in (q, k, v)),
                            causal=True, return_lse=True)
    want_out, want_lse = mhattn.attention(q, k, v, causal=True, return_lse=True)
    got_out, got_lse = _sync(out, lse)
    assert got_out.dtype == np.float16 and got_lse.dtype == want_lse.dtype
    np.testing.assert_allclose(got_out, want_out, rtol=0, atol=4e-3)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6)


def test_bthd_and_unbatched_layouts(rng):
    q, k, v = _arrays(rng, 1, 4, 2, 50, 70)
    for layout, conv in (("bthd", lambda a: a.transpose(0, 2, 1, 3)), ("bhtd", lambda a: a[0])):
        qq, kk, vv = (conv(a) for a in (q, k, v))
        want = mhattn.attention(qq, kk, vv, layout=layout, causal=True)
        got = md.attention(*(da.from_array(a, chunks=17) for a in (qq, kk, vv)),
                           layout=layout, causal=True)
        _close(_sync(got)[0], want, np.float64)
        g = np.ones_like(qq)
        lo, ll = md.attention(*(da.from_array(a, chunks=17) for a in (qq, kk, vv)),
                              layout=layout, causal=True, return_lse=True)
        r = md.attention_grad(da.from_array(g, chunks=17),
                              *(da.from_array(a, chunks=17) for a in (qq, kk, vv)), lo, ll,
                              layout=layout, causal=True)
        w = mhattn.attention_grad(g, qq, kk, vv, layout=layout, causal=True)
        for name in ("q", "k", "v"):
            _close(_sync(r[name])[0], w[name], np.float64)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_the_graph_holds_only_the_blocks_seen(rng, n):
    T = 24 * n - 5   # the last chunk is short
    q, k, v = (da.from_array(a, chunks=(1, 2, 24, 16)) for a in _arrays(rng, 1, 2, 2, T, T))
    assert _count(md.attention(q, k, v)) == n * n
    assert _count(md.attention(q, k, v, causal=True)) == n * (n + 1) // 2
    assert _count(md.attention(q, k, v, window=(10, 0))) == 2 * n - 1
    # key_lengths of 30 keep the first two key chunks only
    kl = md.attention(q, k, v, key_lengths=np.array([min(30, T)]))
    assert _count(kl) == n * min(n, 2)
    # a key_mask whose real keys lie in the first and last key chunks only
    km = np.zeros(T, bool)
    km[[3, T - 1]] = True
    assert _count(md.attention(q, k, v, key_mask=km)) == n * min(n, 2)
    g = md.attention_grad(q, q, k, v, *md.attention(q, k, v, causal=True, return_lse=True),
                          causal=True)
    assert _count(g["q"], "mhattn-attention-grad-") == n * (n + 1) // 2


def test_the_blocks_in_the_graph_are_exactly_those_some_query_sees():
    """The plan's key chunks per query chunk against the dense visibility of
    causal, windows, key lengths and key masks, over random sizes and
    chunks."""
    rng = np.random.default_rng(5)
    for _ in range(80):
        Tq, Tk = (int(t) for t in rng.integers(1, 120, 2))
        cq, ck = (int(c) for c in rng.integers(1, 40, 2))
        causal = bool(rng.integers(2))
        window = None if rng.integers(2) else tuple(
            None if rng.integers(3) == 0 else int(rng.integers(0, 50)) for _ in range(2))
        kl = None if rng.integers(2) else rng.integers(0, Tk + 1, 2)
        km = None if rng.integers(2) else rng.random((2, Tk)) < rng.choice([0.02, 0.2, 0.8])
        q = da.zeros((2, 1, Tq, 4), chunks=(1, 1, cq, 4))
        k = da.zeros((2, 1, Tk, 4), chunks=(1, 1, ck, 4))
        plan = md._Plan(q, k, k, causal, window, kl, km, True)
        p, j = np.arange(Tq)[:, None] + (Tk - Tq), np.arange(Tk)[None, :]
        for b in range(2):
            ok = np.ones((Tq, Tk), bool)
            if causal:
                ok &= j <= p
            if window is not None and window[0] is not None:
                ok &= j >= p - window[0]
            if window is not None and window[1] is not None:
                ok &= j <= p + window[1]
            if kl is not None:
                ok &= j < kl[b]
            if km is not None:
                ok &= km[b][None, :]
            qc, kc = plan.qcut, plan.kcut
            want = [[c for c in range(len(kc) - 1) if ok[qc[i]:qc[i + 1], kc[c]:kc[c + 1]].any()]
                    for i in range(len(qc) - 1)]
            assert plan.seen[b] == want, (Tq, Tk, cq, ck, causal, window, kl, km)


def test_a_chunk_that_sees_nothing(rng):
    """Rows that see no key (causal, more queries than keys): out 0, lse
    -inf, or the sink's logit with sinks; no block task for them."""
    q, k, v = _arrays(rng, 1, 2, 2, 60, 20)
    sinks = np.array([0.25, -2.0])
    for kw in ({}, dict(sinks=sinks)):
        out, lse = md.attention(da.from_array(q, chunks=(1, 2, 20, 16)), da.from_array(k),
                                da.from_array(v), causal=True, return_lse=True, **kw)
        want = mhattn.attention(q, k, v, causal=True, return_lse=True, **kw)
        assert _count(out) == 1
        got = _sync(out, lse)
        _close(got[0], want[0], np.float64)
        _close(got[1], want[1], np.float64)


def test_same_bits_on_every_run_and_scheduler(rng):
    q, k, v = (da.from_array(a, chunks=(1, 2, 23, 16))
               for a in _arrays(rng, 2, 2, 2, 97, 97, dtype=np.float32))
    out, lse = md.attention(q, k, v, causal=True, return_lse=True)
    a = _sync(out, lse)
    b = dask.compute(out, lse, scheduler="threads", num_workers=2)
    c = _sync(*md.attention(q, k, v, causal=True, return_lse=True))
    for x, y, z in zip(a, b, c):
        assert np.array_equal(x, y, equal_nan=True) and np.array_equal(x, z, equal_nan=True)


def test_bad_input_fails_before_any_task_with_mhattns_message(rng):
    ran = []

    def source(block):
        ran.append(1)
        return block

    q, k, v = (da.from_array(a, chunks=(1, 2, 20, 16)).map_blocks(source)
               for a in _arrays(rng, 1, 4, 3, 40, 40))
    ran.clear()
    with pytest.raises(ValueError) as e:
        md.attention(q, k, v)
    assert "k: q's heads = 4 is not a multiple of k's heads = 3" in str(e.value)
    q4 = da.from_array(np.ones((1, 2, 40, 16)), chunks=20).map_blocks(source)
    ran.clear()   # map_blocks called source on its meta
    with pytest.raises(ValueError, match="key_lengths"):
        md.attention(q4, q4, q4, key_lengths=np.array([41]))
    with pytest.raises(ValueError, match="window"):
        md.attention(q4, q4, q4, window=(-1, 0))
    with pytest.raises(ValueError, match="layout"):
        md.attention(q4, q4, q4, layout="thd")
    with pytest.raises(ValueError, match="lse"):
        md.attention_grad(q4, q4, q4, q4, q4, da.ones((1, 2, 39)))
    with pytest.raises(ValueError, match=r"key_mask: expected shape \(40,\) or \(1, 40\)"):
        md.attention(q4, q4, q4, key_mask=np.ones(39, bool))
    with pytest.raises(TypeError, match="key_mask"):
        md.attention_grad(q4, q4, q4, q4, q4, da.ones((1, 2, 40)), key_mask="x")
    assert not ran


def test_tasks_run_mhattn_on_one_thread_when_they_share_a_process(rng):
    seen = []
    before = mhattn.get_num_threads()

    def probe(_):
        with md._task_threads():
            seen.append(mhattn.get_num_threads())
        return _

    t = threading.Thread(target=probe, args=(0,))
    t.start()
    t.join()
    assert seen == [1] and mhattn.get_num_threads() == before
    probe(0)   # the calling thread: the synchronous scheduler's, unchanged
    assert seen[-1] == before


def test_import_mhattn_does_not_import_dask_and_mhattn_dask_says_how():
    code = ("import sys; import mhattn; assert 'dask' not in sys.modules, 'imported'\n"
            "sys.modules['dask'] = None\n"
            "try:\n    import mhattn.dask\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=child_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install mhattn[dask]" in r.stdout


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunks", [(2, 70, 32), (2, 25, 16), (1, 33, 32)])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(20, 0), w_o=None),
                                dict(causal=True, key_lengths=np.array([70, 30, 5]),
                                     sinks=np.array([0.5, 0.0, -0.5, 1.0])),
                                dict(causal=True, key_mask=_key_mask(3, 70, 4))])
def test_multi_head_attention_equals_one_call(rng, dtype, chunks, kw):
    """Chunked along batch only: one mhattn.multi_head_attention per batch
    chunk (map_blocks), no block of attention; along time too: projections,
    mhattn.dask.attention, W^O."""
    kw = dict(kw)
    x = rng.standard_normal((3, 70, 32)).astype(dtype)
    w_q, w_o = ((rng.standard_normal((32, 32)) * 0.2).astype(dtype) for _ in range(2))
    w_k, w_v = ((rng.standard_normal((32, 16)) * 0.2).astype(dtype) for _ in range(2))
    w_o = kw.pop("w_o", w_o)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].astype(dtype)
    out = md.multi_head_attention(da.from_array(x, chunks=chunks), w_q, w_k, w_v, w_o,
                                  num_heads=4, num_kv_heads=2, **kw)
    want = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=4, num_kv_heads=2,
                                       **kw)
    _close(_sync(out)[0], want, dtype)
    assert out.chunks[:2] == da.from_array(x, chunks=chunks).chunks[:2]
    blocks = _count(out)
    assert (blocks == 0) == (chunks[1] == 70)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunks", [(2, 70, 32), (2, 25, 16)])
@pytest.mark.parametrize("with_wo", [True, False])
def test_multi_head_attention_biases_and_gate(rng, dtype, chunks, with_wo):
    """b_q, b_k, b_v, b_o and the output gate: one call per batch chunk
    (T whole) and the blockwise projections (T chunked) both give the one
    call's output; b_o without W^O is added to the concatenation."""
    x = rng.standard_normal((3, 70, 32)).astype(dtype)
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(dtype)  # noqa: E731
    w_q, w_k, w_v = w(32, 32), w(32, 16), w(32, 16)
    w_o = w(32, 24) if with_wo else None
    kw = dict(b_q=w(32), b_k=w(16), b_v=w(16), b_o=w(24 if with_wo else 32),
              w_gate=w(32, 32), b_gate=w(32))
    out = md.multi_head_attention(da.from_array(x, chunks=chunks), w_q, w_k, w_v, w_o,
                                  num_heads=4, num_kv_heads=2, causal=True, **kw)
    want = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=4, num_kv_heads=2,
                                       causal=True, **kw)
    got = _sync(out)[0]
    _close(got, want, dtype)
    # each addition counts: without the gate the output differs
    kw.pop("w_gate"), kw.pop("b_gate")
    plain = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=4, num_kv_heads=2,
                                        causal=True, **kw)
    assert np.abs(plain - want).max() > 1e-2
    with pytest.raises(ValueError, match="b_q"):
        md.multi_head_attention(da.from_array(x, chunks=chunks), w_q, w_k, w_v, w_o,
                                num_heads=4, num_kv_heads=2, b_q=w(31))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunks", [(2, 70, 32), (2, 25, 16), (3, 7, 32)])
@pytest.mark.parametrize("norm", [None, "rms", "layer"])
def test_multi_head_attention_qk_norm_and_rope(rng, dtype, chunks, norm):
    """The q/k norm (per head or shared) and RoPE (full and partial, both
    pairings) give the one call's output whether T is whole or chunked: the
    time chunks turn q and k at their global positions."""
    x = rng.standard_normal((3, 70, 32)).astype(dtype)
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(dtype)  # noqa: E731
    w_q, w_k, w_v, w_o = w(32, 32), w(32, 16), w(32, 16), w(32, 24)
    kw = dict(num_heads=4, num_kv_heads=2, causal=True, b_k=w(16))
    if norm is not None:
        kw.update(q_norm=1 + w(4, 8), k_norm=1 + w(8), norm_type=norm, norm_eps=1e-5)
    for rope in (None, mhattn.RoPE(theta=100.0), mhattn.RoPE(rotary_dim=4, interleaved=True)):
        if norm is None and rope is None:
            continue
        out = md.multi_head_attention(da.from_array(x, chunks=chunks), w_q, w_k, w_v, w_o,
                                      rope=rope, **kw)
        want = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, rope=rope, **kw)
        _close(_sync(out)[0], want, dtype)
    # RoPE moves the output, so positions counted from 0 in each time chunk
    # (a query at 30 turned as 5) would fail the comparison above.
    turned = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, rope=mhattn.RoPE(theta=100.0),
                                         **kw)
    plain = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, **kw)
    assert np.abs(turned - plain).max() > 1e-2
    with pytest.raises(ValueError, match="norm_type"):
        md.multi_head_attention(da.from_array(x, chunks=chunks), w_q, w_k, w_v, w_o,
                                **dict(kw, norm_type="batch"))
    with pytest.raises(ValueError, match="q_norm"):
        md.multi_head_attention(da.from_array(x, chunks=chunks), w_q, w_k, w_v, w_o,
                                **dict(kw, q_norm=w(5)))


@pytest.mark.parametrize("chunks", [(2, 70, 32), (1, 20, 32), (3, 33, 32)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_multi_head_attention_positions(rng, dtype, chunks):
    """positions and key_positions, (T,) or (B, T), alone or together, turn
    q and k as the one call does, T whole or chunked: each time chunk takes
    its columns, each batch chunk its rows."""
    x = rng.standard_normal((3, 70, 16)).astype(dtype)
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(dtype)  # noqa: E731
    w_q, w_k, w_v, w_o = w(16, 16), w(16, 8), w(16, 8), w(16, 12)
    kw = dict(num_heads=4, num_kv_heads=2, causal=True, k_norm=1 + w(4),
              rope=mhattn.RoPE(theta=50.0))
    left_padded = np.maximum(np.arange(70) - rng.integers(0, 20, (3, 1)), 0)
    cases = [dict(positions=np.arange(70) + 5), dict(positions=left_padded),
             dict(key_positions=left_padded[1]),
             dict(positions=left_padded, key_positions=left_padded.astype(np.int32) * 2)]
    default = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, **kw)
    for case in cases:
        want = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, **kw, **case)
        assert np.abs(want - default).max() > 1e-3     # the positions matter
        got = md.multi_head_attention(da.from_array(x, chunks=chunks), w_q, w_k, w_v, w_o,
                                      **kw, **case)
        _close(_sync(got)[0], want, dtype)
    one = md.multi_head_attention(da.from_array(x[1], chunks=(chunks[1], 16)), w_q, w_k, w_v,
                                  w_o, **kw, positions=left_padded[1])
    _close(_sync(one)[0], mhattn.multi_head_attention(x[1], w_q, w_k, w_v, w_o, **kw,
                                                      positions=left_padded[1]), dtype)


@pytest.mark.parametrize("t_chunk", [40, 10])
def test_multi_head_attention_bad_positions_named(t_chunk):
    """Positions of the wrong shape or kind, or without RoPE, are refused
    before a graph is built, naming the argument."""
    x = da.from_array(np.ones((2, 40, 8)), chunks=(1, t_chunk, 8))
    ws = (np.ones((8, 8)),) * 3
    rope = mhattn.RoPE()
    for name, bad, extra in (("positions", np.arange(41), rope),
                             ("key_positions", np.zeros((3, 40), int), rope),
                             ("positions", np.zeros(40), rope),
                             ("key_positions", np.arange(40), None)):
        with pytest.raises((ValueError, TypeError), match=name):
            md.multi_head_attention(x, *ws, num_heads=2, rope=extra, **{name: bad})


@pytest.mark.parametrize("name, bad", [
    ("b_k", np.zeros(15)), ("b_v", np.zeros((2, 8))), ("b_o", np.zeros(7)),
    ("w_gate", np.zeros((8, 7))), ("b_gate", np.zeros(9)), ("k_norm", np.zeros((3, 4))),
    ("norm_eps", -1.0), ("rope", "rope"), ("sinks", np.zeros(3))])
@pytest.mark.parametrize("t_chunk", [40, 10])
def test_multi_head_attention_bad_keywords_named(name, bad, t_chunk):
    """Each layer keyword mhattn.dask forwards is checked before a graph is
    built, T whole or chunked, and the error names it."""
    x = da.from_array(np.ones((2, 40, 8)), chunks=(1, t_chunk, 8))
    kw = {name: bad}
    if name == "b_gate":
        kw["w_gate"] = np.zeros((8, 8))
    with pytest.raises((ValueError, TypeError), match=name):
        md.multi_head_attention(x, np.ones((8, 8)), np.ones((8, 8)), np.ones((8, 8)),
                                num_heads=2, **kw)


def test_multi_head_attention_checks_first(rng):
    x = da.from_array(np.ones((2, 40, 8)), chunks=(1, 10, 8))
    with pytest.raises(ValueError, match="num_heads"):
        md.multi_head_attention(x, np.ones((8, 8)), np.ones((8, 8)), np.ones((8, 8)),
                                num_heads=3)
    with pytest.raises(ValueError, match="key_lengths"):
        md.multi_head_attention(x, np.ones((8, 8)), np.ones((8, 8)), np.ones((8, 8)),
                                num_heads=2, key_lengths=np.array([41, 3]))


@pytest.mark.parametrize("name", md.__all__)
def test_docstring_examples_run(name):
    """mhattn.dask is not in mhattn.__all__ (it imports Dask), so
    tests/test_docstrings.py does not reach its examples: run them here."""
    import doctest
    fn = getattr(md, name)
    assert ">>>" in (fn.__doc__ or "")
    runner = doctest.DocTestRunner()
    for t in doctest.DocTestFinder().find(fn, name, globs=dict(np=np, mhattn=mhattn)):
        runner.run(t)
    assert runner.failures == 0


# ---- a LocalCluster of two processes: few and small -------------------------

@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1,
                                  dashboard_address=":0", silence_logs=40) as cluster:
        with distributed.Client(cluster) as c:
            yield c


@pytest.mark.cluster
def test_on_a_local_cluster_the_bits_are_the_synchronous_ones(rng, client):
    q, k, v = (da.from_array(a, chunks=(1, 2, 40, 16))
               for a in _arrays(rng, 2, 2, 2, 150, 150, dtype=np.float32))
    out, lse = md.attention(q, k, v, causal=True, return_lse=True)
    res = md.attention_grad(q, q, k, v, out, lse, causal=True)
    got = client.compute([out, lse, res], sync=True)
    want = _sync(out, lse, res)
    for x, y in zip(got[:2], want[:2]):
        assert np.array_equal(x, y, equal_nan=True)
    for name in ("q", "k", "v"):
        assert np.array_equal(got[2][name], want[2][name])
    # a task on a worker runs mhattn on one thread (the worker has one)
    assert client.submit(_threads_in_a_task, pure=False).result() == 1


def _threads_in_a_task():
    with md._task_threads():
        return mhattn.get_num_threads()


def _held_threads(pause):
    """In a task: mhattn's thread count inside the module's context, and when
    the task held it (monotonic clock), for the overlap check below."""
    import time
    with md._task_threads():
        t0 = time.monotonic()
        n = mhattn.get_num_threads()
        time.sleep(pause)
        return n, t0, time.monotonic()


@pytest.mark.cluster
def test_a_lone_task_takes_the_workers_threads_and_never_oversubscribes():
    distributed = pytest.importorskip("distributed")
    before = mhattn.get_num_threads()
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                  dashboard_address=":0", silence_logs=40) as cluster, \
            distributed.Client(cluster) as c:
        lone = c.submit(_held_threads, 0.0, pure=False).result()
        assert lone[0] == 2   # alone on a worker of 2 threads: both
        import time
        first = c.submit(_held_threads, 0.5, pure=False)   # alone: wide
        time.sleep(0.15)
        runs = c.gather([first] + [c.submit(_held_threads, 0.2, pure=False)
                                   for _ in range(5)])
    assert runs[0][0] == 2
    # the five that came while it ran waited for it: the threads of the
    # tasks holding the context at any moment add up to at most the two
    for _, t0, _ in runs:
        assert sum(n for n, a, b in runs if a <= t0 < b) <= 2, runs
    assert mhattn.get_num_threads() == before


def _slow(block):
    import time
    time.sleep(0.3)
    return block


@pytest.mark.cluster
def test_a_worker_killed_mid_compute_gives_the_same_result(rng, client):
    import signal
    import time
    q, k, v = (da.from_array(a, chunks=(1, 2, 30, 16)).map_blocks(_slow)
               for a in _arrays(rng, 1, 2, 2, 120, 120))
    out = md.attention(q, k, v, causal=True)
    want = _sync(out)[0]
    fut = client.compute(out)
    time.sleep(1.0)
    pids = client.run(os.getpid)
    victim = pids[sorted(pids)[0]]
    assert not fut.done()
    os.kill(victim, signal.SIGKILL)   # the Nanny restarts it; Dask reruns its tasks
    got = fut.result(timeout=120)
    assert np.array_equal(got, want)
    assert victim not in client.run(os.getpid).values()   # it was killed, and replaced
