"""The golden grid: calls whose exact output bits are pinned per ISA.

Each case is a name and a function of an ISA-independent seed that returns
the arrays it produces (forward outputs, weights, lse and gradients), so a
restructure of the core can be checked to change no bit.  Shapes cross the
tile edges of every ISA (forward: 96 or 192 query rows, 64 or 128 keys;
backward: 64 x 64) and include widths that are not a multiple of any
vector width.  `tests/golden/make_golden.py` records the bits;
`tests/test_golden.py` compares them.
"""
import numpy as np

import mhattn


def _w(rng, shape, dtype, s=0.3):
    return (rng.standard_normal(shape) * s).astype(dtype)


def _setup(seed, dtype, B, Tq, Tk, d_in, h, dk, dv=None, d_out=None, g=None,
           cross=False, form="fused", ragged=None):
    rng = np.random.default_rng(seed)
    dv = dk if dv is None else dv
    g = h if g is None else g
    d_out = d_in if d_out is None else d_out
    shp = (lambda T, d: (B, T, d)) if B else (lambda T, d: (T, d))
    x = _w(rng, shp(Tq, d_in), dtype, 1.0)
    key = _w(rng, shp(Tk, d_in), dtype, 1.0) if cross else None
    if ragged is not None:
        w_q = [_w(rng, (d_in, w), dtype) for w in ragged]
        w_k = [_w(rng, (d_in, w), dtype) for w in ragged]
        w_v = [_w(rng, (d_in, w + 1), dtype) for w in ragged]
        svq = sum(w + 1 for w in ragged)
        kw = dict()
    else:
        def make(n, width):
            hs = [_w(rng, (d_in, width), dtype) for _ in range(n)]
            if form == "list":
                return hs
            if form == "stacked":
                return np.stack(hs)
            return np.concatenate(hs, axis=1)
        w_q, w_k, w_v = make(h, dk), make(g, dk), make(g, dv)
        svq = h * dv
        kw = dict(num_heads=h) if form == "fused" else {}
        if g != h:
            kw["num_kv_heads"] = g
    w_o = _w(rng, (svq, d_out), dtype)
    return rng, x, key, w_q, w_k, w_v, w_o, kw


def _run(rng, x, w_q, w_k, w_v, w_o, kw, weights=True, grad=True):
    """Forward (out, weights, lse via the context) and the backward."""
    res = {}
    out = mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, return_weights=weights,
                                      return_context=grad, **kw)
    if grad:
        *fw, ctx = out
        res["lse"] = ctx.lse
        res["concat"] = ctx.concat
    else:
        fw = out if weights else (out,)
        fw = list(fw) if isinstance(fw, tuple) else [fw]
    res["out"] = fw[0]
    if weights:
        res["weights"] = fw[1]
    if grad:
        g_out = rng.standard_normal(res["out"].shape).astype(res["out"].dtype)
        grads = mhattn.backward(g_out, ctx)
        for name, gr in grads.items():
            if isinstance(gr, list):
                for i, gi in enumerate(gr):
                    res[f"d{name}[{i}]"] = gi
            else:
                res[f"d{name}"] = gr
        # The one-call form too (it must agree with the context form).
        one = mhattn.multi_head_attention_grad(g_out, x, w_q, w_k, w_v, w_o, **kw)
        for name, gr in one.items():
            if not isinstance(gr, list):
                res[f"grad1_{name}"] = gr
    return res


def case(seed, dtype, *, B=2, Tq=7, Tk=None, d_in=12, h=3, dk=5, dv=None, d_out=None,
         g=None, cross=False, form="fused", ragged=None, weights=True, grad=True,
         mask=None, causal=False, key_lengths=None, bias=False, scale=None,
         qk_norm=None, rope=False):
    Tk = Tq if Tk is None else Tk
    rng, x, key, w_q, w_k, w_v, w_o, kw = _setup(
        seed, dtype, B, Tq, Tk, d_in, h, dk, dv, d_out, g, cross, form, ragged)
    if cross:
        kw["key"] = key
    if causal:
        kw["causal"] = True
    if scale is not None:
        kw["scale"] = scale
    if key_lengths is not None:
        kw["key_lengths"] = np.asarray(key_lengths) if B else key_lengths
    if mask == "bool":
        shape = ((B,) if B else ()) + (h, Tq, Tk)
        m = rng.random(shape) > 0.3
        kw["mask"] = m
    elif mask == "bool_bcast":
        kw["mask"] = rng.random((Tq, Tk)) > 0.4
    elif mask == "add":
        shape = ((B,) if B else ()) + (1, Tq, Tk)
        m = rng.standard_normal(shape).astype(dtype)
        m[..., ::3, 1::4] = -np.inf
        kw["mask"] = m
    if bias:
        n_q = w_q.shape[-1] if not isinstance(w_q, list) else None
        if form == "fused":
            kw["b_q"] = _w(rng, (w_q.shape[1],), dtype)
            kw["b_k"] = _w(rng, (w_k.shape[1],), dtype)
            kw["b_v"] = _w(rng, (w_v.shape[1],), dtype)
        del n_q
        kw["b_o"] = _w(rng, (w_o.shape[1],), dtype)
    # The q/k RMSNorm (issue 38 pins its bits before LayerNorm joins it):
    # weights drawn last, so the cases above keep their draws.
    if qk_norm is not None:
        g_ = h if g is None else g
        kw["q_norm"] = 1 + _w(rng, (h, dk) if qk_norm == "per_head" else (dk,), dtype)
        kw["k_norm"] = 1 + _w(rng, (g_, dk) if qk_norm == "per_head" else (dk,), dtype)
    if rope:
        kw["rope"] = mhattn.RoPE(rotary_dim=dk - dk % 2)
    return _run(rng, x, w_q, w_k, w_v, w_o, kw, weights=weights, grad=grad)


def qk_norm_cached(dtype, per_head):
    """Decode through a KVCache with the q/k RMSNorm and RoPE: a prefill of
    5 rows, then 3 single-row steps; the outputs of every step."""
    rng = np.random.default_rng(38 + per_head)
    B, h, g, dk, d_in = 2, 4, 2, 6, 12
    w_q, w_k, w_v = (_w(rng, (d_in, n * dk), dtype) for n in (h, g, g))
    w_o = _w(rng, (h * dk, d_in), dtype)
    q_norm = 1 + _w(rng, (h, dk) if per_head else (dk,), dtype)
    k_norm = 1 + _w(rng, (g, dk) if per_head else (dk,), dtype)
    x = _w(rng, (B, 8, d_in), dtype, 1.0)
    cache = mhattn.KVCache(B, g, 16, dk, dtype=dtype)
    res = {}
    for i, (a, b) in enumerate(((0, 5), (5, 6), (6, 7), (7, 8))):
        res[f"step{i}"] = mhattn.multi_head_attention(
            x[:, a:b], w_q, w_k, w_v, w_o, num_heads=h, num_kv_heads=g, causal=True,
            q_norm=q_norm, k_norm=k_norm, rope=mhattn.RoPE(), cache=cache)
    return res


def worked_example():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    rng = np.random.default_rng(7)
    return _run(rng, X, w_q, w_k, w_v, w_o, {}, weights=True, grad=True)


# name -> zero-argument function; one entry per dtype.
CASES = {"worked_example": worked_example}


def _add(name, **kw):
    for dt, tag in ((np.float32, "f32"), (np.float64, "f64")):
        CASES[f"{name}-{tag}"] = lambda kw=kw, dt=dt: case(_seed(name), dt, **kw)


def _seed(name):
    # A stable seed per case name (Python's hash() is salted per process).
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") % (2**32) + len(name)


_add("plain", B=2, Tq=7, h=3, dk=5)
_add("unbatched", B=0, Tq=9, h=2, dk=4)
_add("t1", B=1, Tq=1, h=1, dk=3)
_add("one_head", B=2, Tq=11, h=1, dk=13, d_in=13)
_add("stacked", B=2, Tq=6, h=4, dk=3, form="stacked")
_add("list", B=1, Tq=6, h=3, dk=4, form="list")
_add("ragged", B=2, Tq=8, d_in=10, ragged=[3, 5, 2])
_add("dk_ne_dv", B=2, Tq=10, h=3, dk=4, dv=7, d_out=9)
_add("cross", B=2, Tq=5, Tk=13, h=2, dk=6, cross=True)
_add("cross_causal_tq_gt_tk", B=2, Tq=13, Tk=5, h=2, dk=6, cross=True, causal=True)
_add("causal", B=2, Tq=17, h=3, dk=5, causal=True)
_add("causal_cross", B=1, Tq=9, Tk=20, h=2, dk=6, cross=True, causal=True)
_add("key_lengths", B=3, Tq=10, h=2, dk=5, key_lengths=[10, 4, 0])
_add("key_lengths_causal", B=3, Tq=12, h=2, dk=5, key_lengths=[12, 7, 1], causal=True)
_add("mask_bool", B=2, Tq=9, h=3, dk=5, mask="bool")
_add("mask_bool_bcast", B=2, Tq=9, h=2, dk=5, mask="bool_bcast")
_add("mask_add", B=2, Tq=9, h=2, dk=5, mask="add")
_add("mask_add_causal", B=2, Tq=10, h=2, dk=5, mask="add", causal=True)
_add("gqa", B=2, Tq=9, h=6, g=2, dk=4)
_add("mqa_causal", B=1, Tq=12, h=4, g=1, dk=8, causal=True)
_add("bias", B=2, Tq=8, h=2, dk=5, bias=True)
_add("scale", B=2, Tq=8, h=2, dk=5, scale=0.7)
_add("no_wo_weights_only", B=2, Tq=8, h=2, dk=5, grad=False)
# Across tile edges (forward 96 / 192 rows, 64 / 128 keys; backward 64 x 64).
_add("tiles", B=1, Tq=200, Tk=200, d_in=24, h=2, dk=9, weights=False)
_add("tiles_causal", B=1, Tq=197, d_in=20, h=2, dk=17, causal=True, weights=False)
_add("tiles_cross_lengths", B=2, Tq=70, Tk=140, d_in=16, h=2, dk=8, dv=11, cross=True,
     key_lengths=[140, 77], weights=True)
_add("tiles_mask_gqa", B=1, Tq=130, Tk=130, d_in=16, h=4, g=2, dk=8, mask="bool_bcast",
     weights=False)
# The q/k RMSNorm (shared and per-head weights, with RoPE, GQA, causal, an
# odd d_k, a key/query width past one vector): its bits are pinned here, as
# recorded before norm_type="layer" joined it (issue 38).
_add("qk_norm_shared", B=2, Tq=7, h=3, dk=5, qk_norm="shared")
_add("qk_norm_per_head_gqa_causal", B=2, Tq=9, h=4, g=2, dk=7, qk_norm="per_head",
     causal=True, bias=True)
_add("qk_norm_rope_cross", B=1, Tq=6, Tk=11, h=2, dk=8, cross=True, qk_norm="shared",
     rope=True)
_add("qk_norm_rope_tiles", B=1, Tq=130, d_in=16, h=2, dk=17, qk_norm="per_head", rope=True,
     causal=True, weights=False)
for _dt, _tag in ((np.float32, "f32"), (np.float64, "f64")):
    for _ph in (0, 1):
        CASES[f"qk_norm_cached_{'per_head' if _ph else 'shared'}-{_tag}"] = (
            lambda dt=_dt, ph=_ph: qk_norm_cached(dt, ph))
