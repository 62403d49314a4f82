"""Fuzz every public entry point of mhattn besides the layer's forward.

    python fuzz/fuzz_entry_points.py -max_total_time=60 NEW_CORPUS_DIR fuzz/corpus_entry_points

(atheris, i.e. libFuzzer, as fuzz/fuzz_mha.py, whose decoder and hostile
values it shares; ``--replay PATH...`` runs files or directories through
test_one_input once, without atheris.) The first byte picks an entry point;
the rest build its arguments, small (a few heads, a few rows), now and then
hostile: garbage in place of an argument, a wrong shape or dtype, an odd
memory layout, a bad variant value:

  attention, attention_grad, merge_attention, KVCache (constructor, append,
  check_room) and the cached step, pack_weights and its object in a call
  (and replace), multi_head_attention_grad, backward and trace on
  fuzz_mha's decoded calls (every variant), Trace's methods, RoPE, the
  layer (constructor, call, backward, load_state_dict), the checkers on a
  small generated prototype, plot_attention, the PyTorch mask converters,
  param_count, set_num_threads; BlockMask (from a function or a dense mask)
  in attention, and PagedKVCache (add, append, free, attention).

The properties: no crash, no hang, and nothing escapes but TypeError,
ValueError or MemoryError (IndexError too where it is documented: a head or
batch index); anything else is re-raised as a finding. A call that works
is checked against another way of computing the same thing: attention
against the reference, merged parts against the whole, a cached decode
against the full causal call, packed weights against the unpacked call
(bit for bit), backward against multi_head_attention_grad, the trace's
output against the forward's, a correct prototype passes the checker.

Set MHATTN_FUZZ_NAMES=1 to also require every TypeError or ValueError to
name its argument before a colon (a developer's run: some entry points do
not yet, see KNOWN).
"""
from __future__ import annotations

import os
import re
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_mha import GARBAGE, LAYOUTS, Data, build as build_mha_call, inputs_in  # noqa: E402
from fuzz_mha import main as run_harness  # noqa: E402

NAMES = os.environ.get("MHATTN_FUZZ_NAMES") == "1"
ALLOWED = (TypeError, ValueError, MemoryError)
# Escapes known today that the properties would refuse; each line goes
# when its entry point is fixed: (entry, exception type, message pattern).
KNOWN: list = []   # (entry, exception type, message regex) of a known escape;
                   # issue 35 fixed the last ones (Trace.head, plot_attention's
                   # batch, KVCache.check_room)
# The documented IndexErrors: an index out of range, named.
INDEX_OK = re.compile(r"^(heads|batch|head|b): |^head \d+ out of range")
NAME_RE = re.compile(r"^[A-Za-z_][\w.\[\]()/, '*=-]*: ")


class Finding(AssertionError):
    """A property failed."""


def vals(rng, shape, dtype=np.float64):
    """Multiples of 1/4 in [-2, 2]: exact in float32."""
    return (rng.integers(-8, 9, shape) / 4).astype(dtype)


def hostile(d: Data, value, n: int = 8):
    """value, or (with probability 1/n) something else in its place: garbage,
    a wrong shape, a wrong dtype, non-finite values or an odd layout."""
    if not d.rarely(n):
        return value
    how = d.int(0, 5)
    if how == 0 or not isinstance(value, np.ndarray):
        return d.pick(GARBAGE)
    if how == 1:
        return value[..., None] if d.chance(2) or not value.shape[:1] else value[:1].sum(0)
    if how == 2:
        return value.astype(d.pick([np.float16, np.int32, np.complex128, np.bool_, object]))
    if how == 3 and value.size and value.dtype.kind == "f":
        v = value.copy()
        v.flat[d.int(0, v.size - 1)] = d.pick([np.nan, np.inf, -np.inf])
        return v
    if how == 4:
        return d.pick(LAYOUTS)(value)
    return np.zeros(value.shape[:-1] + (0,), value.dtype) if value.ndim else value


def layout(d: Data, a):
    """a in an unusual memory layout, now and then."""
    numeric = isinstance(a, np.ndarray) and a.dtype.kind in "biuf"
    return d.pick(LAYOUTS[:9])(a) if numeric and d.chance(4) else a


def close(got, want, what, dtype=None, tol=None):
    """got ~ want where want is finite (float32, or ``dtype``: 1e-4; float64:
    1e-10; a half result: one of its ulps; ``tol`` when given; relative to
    the largest magnitude)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise Finding(f"{what}: shape {got.shape}, expected {want.shape}")
    fin = np.isfinite(want)
    if not fin.any():
        return
    dt = np.dtype(dtype or got.dtype)
    half = [a.dtype for a in (got, want)
            if a.dtype == np.float16 or (a.dtype.kind == "V" and a.dtype.itemsize == 2)]
    if half:
        # a half result on either side (a half call's out, against a trace's
        # float32 stages): float32's, rounded once (held to one ulp)
        got, want = got.astype(np.float64), want.astype(np.float64)
    if tol is None and half:
        tol = 2.0 ** -10 if all(h == np.float16 for h in half) else 2.0 ** -7
    elif tol is None:
        tol = 1e-4 if dt == np.float32 else 1e-10
    scale = max(1.0, float(np.abs(want[fin]).max()))
    err = float(np.abs(np.where(fin, got, 0) - np.where(fin, want, 0)).max())
    if not np.isfinite(got[fin]).all() or err > tol * scale:
        raise Finding(f"{what}: differs by {err:.3g} (tolerance {tol * scale:.3g})")


# --- the entry points ---------------------------------------------------------
def score_variants(d: Data, rng, H, Tk, lead):
    """Some of the score variants, valid or not."""
    kw = {}
    if d.chance(4):
        kw["softcap"] = d.pick([1.0, 5.0, 30.0, 0.0, -1.0, np.nan, "a"])
    if d.chance(5):
        kw["sinks"] = hostile(d, vals(rng, (H,)))
    if d.chance(5):
        kw["key_mask"] = hostile(d, rng.random(lead + (Tk,)) > 0.3)
    if d.chance(5):
        kw["window"] = (d.pick([None, 0, 1, 3, -1]), d.pick([None, 0, 2]))
    if d.chance(5):
        kw["alibi_slopes"] = hostile(d, rng.random((H,)))
    return kw


def projected(d: Data, rng):
    """q, k, v and sizes for attention: batched or not, either layout."""
    dtype = d.pick([np.float64, np.float32, np.float32, np.int64])
    lay = d.pick(["bhtd", "bthd"])
    B, G, group = d.int(1, 2), d.int(1, 2), d.int(1, 2)
    H, Tq, Tk, dk, dv = G * group, d.int(0, 4), d.int(0, 5), d.int(1, 3), d.int(1, 3)
    batched = d.chance(2)
    lead = (B,) if batched else ()

    def t(heads, T, width):
        shape = (heads, T, width) if lay == "bhtd" else (T, heads, width)
        return vals(rng, lead + shape, dtype)
    return dict(q=t(H, Tq, dk), k=t(G, Tk, dk), v=t(G, Tk, dv), layout=lay), \
        dict(B=B, H=H, G=G, Tq=Tq, Tk=Tk, dk=dk, dv=dv, lead=lead, dtype=dtype)


def fuzz_attention(d: Data, rng):
    import mhattn
    from mhattn import reference
    kw, s = projected(d, rng)
    kw.update(score_variants(d, rng, s["H"], s["Tk"], s["lead"]))
    kw["causal"] = bool(d.int(0, 1))
    if d.chance(4):
        kw["scale"] = d.pick([0.5, 2.0, 0.0, -1.0, np.float32(0.25), "a", np.ones(2)])
    if d.chance(4):
        kw["key_lengths"] = rng.integers(0, s["Tk"] + 2, s["lead"])
    for name in ("q", "k", "v", "layout"):
        kw[name] = layout(d, hostile(d, kw[name], 10))
    lse = d.chance(3)
    out = attempt("attention", lambda: mhattn.attention(**kw, return_lse=lse))
    if out is RAISED:
        return
    ref = reference.projected_attention(**kw)
    close(out[0] if lse else out, ref[0], "attention out")
    if lse:
        close(out[1], ref[2], "attention lse")


def fuzz_attention_grad(d: Data, rng):
    import mhattn
    kw, s = projected(d, rng)
    kw.update(score_variants(d, rng, s["H"], s["Tk"], s["lead"]))
    kw["causal"] = bool(d.int(0, 1))
    fwd = attempt("attention", lambda: mhattn.attention(**kw, return_lse=True))
    shape = (s["Tq"], s["H"], s["dv"]) if kw["layout"] == "bthd" else (s["H"], s["Tq"], s["dv"])
    g = hostile(d, vals(rng, s["lead"] + shape), 6)
    extra = {}
    given = fwd is not RAISED and d.chance(2)
    if given:
        extra = dict(out=hostile(d, fwd[0], 6), lse=hostile(d, fwd[1], 6))
        given = extra["out"] is fwd[0] and extra["lse"] is fwd[1]      # untouched
    grads = attempt("attention_grad", lambda: mhattn.attention_grad(g, **kw, **extra))
    if grads is RAISED or fwd is RAISED:
        return
    for name in ("q", "k", "v"):
        if grads[name].shape != np.shape(kw[name]):
            raise Finding(f"attention_grad: d{name} {grads[name].shape}, "
                          f"{name} {np.shape(kw[name])}")
    if given:
        again = mhattn.attention_grad(g, **kw)      # out and lse recomputed
        for name in grads:
            close(grads[name], again[name], f"attention_grad d{name}, given out and lse")


def fuzz_merge(d: Data, rng):
    import mhattn
    kw, s = projected(d, rng)
    if s["dtype"] == np.int64:
        kw.update({n: kw[n].astype(np.float64) for n in "qkv"})
    axis = -2 if kw["layout"] == "bhtd" else -3          # T_k of k and v
    cut = d.int(0, s["Tk"])
    opts = {}
    if d.chance(3):
        opts["softcap"] = d.pick([1.0, 5.0])
    if d.chance(3):
        opts["scale"] = d.pick([0.5, 2.0])
    key_mask = rng.random(s["lead"] + (s["Tk"],)) > 0.3 if d.chance(3) else None

    def part(sl):
        k = np.take(kw["k"], range(s["Tk"])[sl], axis=axis)
        v = np.take(kw["v"], range(s["Tk"])[sl], axis=axis)
        km = None if key_mask is None else key_mask[..., sl]
        return mhattn.attention(kw["q"], k, v, layout=kw["layout"], key_mask=km,
                                return_lse=True, **opts)
    a, b = part(slice(0, cut)), part(slice(cut, None))
    outs, lses = [a[0], b[0]], [a[1], b[1]]
    tampered = d.rarely(3)
    if tampered:
        which = d.pick([outs, lses])
        which[d.int(0, 1)] = hostile(d, which[0], 1)
    if d.rarely(6):
        outs, lses = d.pick([(tuple(outs), tuple(lses)), (iter(outs), iter(lses)),
                             (outs[:1], lses), (d.pick(GARBAGE), lses)])
    lay = hostile(d, kw["layout"], 12)
    merged = attempt("merge_attention", lambda: mhattn.merge_attention(outs, lses, layout=lay))
    if merged is RAISED or tampered:
        return
    whole = mhattn.attention(kw["q"], kw["k"], kw["v"], layout=kw["layout"],
                             key_mask=key_mask, return_lse=True, **opts)
    close(merged[0], whole[0], "merge_attention out")
    close(merged[1], whole[1], "merge_attention lse")


def layer_weights(d: Data, rng, dtype):
    """(x-width, weights dict, H, G, dk, dv) of a small fused layer."""
    G = d.int(1, 2)
    H = G * d.int(1, 2)
    dk, dv, d_in = d.int(1, 3), d.int(1, 3), d.int(1, 5)
    w = dict(w_q=vals(rng, (d_in, H * dk), dtype), w_k=vals(rng, (d_in, G * dk), dtype),
             w_v=vals(rng, (d_in, G * dv), dtype), num_heads=H, num_kv_heads=G)
    if d.chance(2):
        w["w_o"] = vals(rng, (H * dv, d.int(1, 4)), dtype)
    return d_in, w, H, G, dk, dv


def cache_dtype(d: Data):
    """(the cache's dtype, the rows' dtype): float32 or float64, or a half or
    int8 cache (issue 36) taking float32 rows (a half cache: also its own
    dtype's; bfloat16 only where ml_dtypes imports)."""
    kinds = [np.float32, np.float64, np.float16, "int8"]
    try:
        import ml_dtypes
        kinds.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    kind = d.pick(kinds)
    if kind in (np.float32, np.float64):
        return kind, kind
    return kind, np.float32 if kind == "int8" or d.chance(2) else kind


def fuzz_cache(d: Data, rng):
    """KVCache's constructor, append and check_room against a model of it."""
    import mhattn
    dtype, rows = cache_dtype(d)
    B, G, C, dk = d.int(1, 3), d.int(1, 2), d.int(1, 6), d.int(1, 3)
    dv = d.pick([None, dk, d.int(1, 3)])
    args = [hostile(d, a, 10) for a in (B, G, C, dk)]
    cache = attempt("KVCache", lambda: mhattn.KVCache(*args, d_v=hostile(d, dv, 10),
                                                      dtype=hostile(d, dtype, 10)))
    if cache is RAISED:
        return
    dv = cache.d_v
    keys = [[] for _ in range(B)]
    for _ in range(d.int(1, 4)):
        T = d.int(0, 3)
        k = hostile(d, vals(rng, (B, G, T, dk), rows), 6)
        v = hostile(d, vals(rng, (B, G, T, dv), rows), 6)
        lengths = rng.integers(0, T + 1, B) if d.chance(3) else None
        lengths = hostile(d, lengths, 6)
        before = (cache.lengths.copy(), cache.key_storage.copy())
        if d.rarely(6):
            counts = hostile(d, rng.integers(-1, C + 1, B), 4)
            attempt("KVCache.check_room", lambda: cache.check_room(counts))
        elif attempt("KVCache.append", lambda: cache.append(k, v, lengths=lengths)) is RAISED:
            if not (np.array_equal(cache.lengths, before[0])
                    and np.array_equal(cache.key_storage, before[1], equal_nan=True)):
                raise Finding("KVCache.append raised but changed the cache")
            continue
        else:
            n = np.full(B, T) if lengths is None else np.asarray(lengths)
            for b in range(B):
                keys[b] += list(np.asarray(k)[b, :, :n[b]].swapaxes(0, 1))
        for b in range(B):
            n = len(keys[b])
            want = np.array(keys[b], np.float64).reshape(-1, G, dk).swapaxes(0, 1)
            held = cache.key_storage[b, :, :n]
            if cache.key_scales is not None:
                # int8: each row dequantised within max|row| / 254 of it
                got = held.astype(np.float64) * cache.key_scales[b, :, :n, None]
                bound = np.abs(want).max(axis=-1, keepdims=True, initial=0) / 254 * 1.0001
                ok = bool(np.all((np.abs(got - want) <= bound) | (np.isnan(got) & ~np.isfinite(
                    want).all(axis=-1, keepdims=True))))
            else:
                # a half cache holds each value rounded once (numpy's astype
                # rounds to nearest even, as the cache does)
                ok = np.array_equal(held, want.astype(np.dtype(rows)).astype(cache.dtype),
                                    equal_nan=True)
            if cache.lengths[b] != n or not ok:
                raise Finding(f"KVCache: sequence {b} does not hold what was appended")


def fuzz_cached_step(d: Data, rng):
    """Decoding x chunk by chunk through a cache = the full causal call."""
    import mhattn
    dtype = d.pick([np.float32, np.float64])
    d_in, w, H, G, dk, dv = layer_weights(d, rng, dtype)
    B, T = d.int(1, 2), d.int(1, 5)
    x = vals(rng, (B, T, d_in), dtype)
    kw = score_variants(d, rng, H, T, (B,))
    kw.pop("key_mask", None)
    if d.chance(4):
        kw["q_norm"] = vals(rng, (dk,), dtype)
    if d.chance(4):
        kw["rope"] = mhattn.RoPE(theta=d.pick([10.0, 1e4]), interleaved=bool(d.int(0, 1)),
                                 rotary_dim=d.pick([None, 2]) if dk >= 2 else None)
    if d.chance(6):                  # a keyword a cached step refuses
        kw[d.pick(["key", "mask", "key_lengths", "positions", "cu_seqlens"])] = np.ones(2)
    weights = w
    if d.chance(4):
        weights = dict(w_q=mhattn.pack_weights(**w))
    cdtype = dtype
    if dtype == np.float32 and d.chance(3):          # a half or int8 cache
        cdtype = cache_dtype(d)[0]
    cache = attempt("KVCache", lambda: mhattn.KVCache(B, G, T + d.int(0, 2), dk, dv,
                                                      dtype=hostile(d, cdtype, 12)))
    if cache is RAISED:
        return
    outs, t = [], 0
    while t < T:
        n = d.int(1, T - t)
        chunk = hostile(d, x[:, t:t + n], 12)
        out = attempt("multi_head_attention(cache=)", lambda: mhattn.multi_head_attention(
            chunk, **weights, cache=cache, causal=True, **kw))
        if out is RAISED or getattr(chunk, "base", None) is not x:   # not x's rows
            return
        outs.append(out)
        t += n
    full = mhattn.multi_head_attention(x, **w, causal=True, **kw)
    # a half or int8 cache holds k and v rounded: bfloat16's 2^-8 relative
    # per value; int8's max|row| / 254 (the docstring's bound, loosely)
    tol = {2: 2.0 ** -6, 1: 2.0 ** -5}.get(cache.dtype.itemsize)
    close(np.concatenate(outs, axis=1), full, "cached step vs the full causal call", dtype,
          tol=tol)


def fuzz_packed(d: Data, rng):
    """pack_weights, its object in a call (the same bits), replace, backward."""
    import mhattn
    dtype = d.pick([np.float32, np.float64])
    d_in, w, H, G, dk, dv = layer_weights(d, rng, dtype)
    if d.chance(3):                                      # stacked or per-head lists
        w["w_q"] = np.stack(np.split(w["w_q"], H, axis=1))
        w["w_k"] = list(np.split(w["w_k"], G, axis=1))
        w["w_v"] = np.stack(np.split(w["w_v"], G, axis=1))
        w.pop("num_heads")
    if d.chance(4):
        w["b_q"] = vals(rng, (H * dk,), dtype)
    for name in list(w):
        w[name] = hostile(d, w[name], 14)
    pdtype = hostile(d, d.pick([None, np.float32, np.float64]), 10)
    packed = attempt("pack_weights", lambda: mhattn.pack_weights(**w, dtype=pdtype))
    if packed is RAISED:
        return
    if d.chance(4):
        change = {d.pick(["w_o", "w_k", "b_o", "w_x"]): hostile(d, vals(rng, (H * dv, 2)), 3)}
        packed = attempt("PackedWeights.replace", lambda: packed.replace(**change))
        if packed is RAISED:
            return
    x = vals(rng, (d.int(0, 2), d.int(0, 4), d_in) if d.chance(2) else (3, d_in),
             d.pick([np.float32, np.float64]))
    opts = dict(causal=bool(d.int(0, 1)))
    if d.chance(4):
        opts[d.pick(["w_k", "w_o", "num_heads", "num_kv_heads", "b_q"])] = d.pick(
            [w.get("w_k"), 1, H, np.ones(3)])
    got = attempt("multi_head_attention(packed)", lambda: mhattn.multi_head_attention(
        x, packed, return_context=True, **opts))
    if got is RAISED:
        return
    if any(type(opts.get(n, 0)) is not int for n in ("num_heads", "num_kv_heads")):
        # Known: with a PackedWeights, num_heads / num_kv_heads are compared
        # with the object's but not checked: 2.0, np.array(2), True (for 1)
        # pass where the unpacked call raises TypeError.
        return
    want = mhattn.multi_head_attention(x, **{**packed.arguments(), **opts})
    if not np.array_equal(got[0], want, equal_nan=True):
        raise Finding("packed weights: not the unpacked call's bits")
    g = vals(rng, got[0].shape, got[0].dtype)
    grads = mhattn.backward(g, got[1])
    again = mhattn.multi_head_attention_grad(g, x, packed, **opts)
    for name in ("x", "w_q", "w_o"):
        if name in grads:
            close(np.asarray(grads[name]), np.asarray(again[name]), f"packed backward d{name}")


def fuzz_grad_and_trace(d: Data, rng):
    """fuzz_mha's decoded call (every variant), through multi_head_attention_grad,
    multi_head_attention(return_context=True) + backward, and trace."""
    import mhattn
    kw, _ = build_mha_call(d)
    kw.pop("_packed", None)
    kw.pop("_attention", None)
    want_w = kw.pop("return_weights", False)
    fwd = attempt("multi_head_attention", lambda: mhattn.multi_head_attention(
        **kw, return_context=True))
    shape = fwd[0].shape if fwd is not RAISED else (3, 4)
    g = hostile(d, vals(rng, shape), 8)
    # seed=None (a garbage pick that is valid) draws a fresh dropout mask
    # on each call: two calls then agree on nothing to compare.
    fresh = kw.get("seed", 0) is None and kw.get("dropout", 0) != 0
    which = d.int(0, 2)
    if which == 0:
        grads = attempt("multi_head_attention_grad",
                        lambda: mhattn.multi_head_attention_grad(g, **kw))
        if grads is not RAISED and fwd is not RAISED and not fresh:
            again = mhattn.backward(g, fwd[1])
            for name in grads:
                if isinstance(grads[name], np.ndarray):
                    close(grads[name], again[name], f"grad d{name} vs backward")
    elif which == 1 and fwd is not RAISED:
        ctx = d.pick([fwd[1]] * 6 + [None, "ctx"])
        attempt("backward", lambda: mhattn.backward(g, ctx))
    else:
        tk = {}
        if d.chance(3):
            x = kw["x"]
            T = x.shape[-2] if isinstance(x, np.ndarray) and x.ndim >= 2 else 3
            tk["tokens"] = hostile(d, [f"t{i}" for i in range(T)], 4)
        tr = attempt("trace", lambda: mhattn.trace(**kw, **tk))
        if tr is RAISED:
            return
        if fwd is not RAISED and not fresh:
            close(tr.output, fwd[0], "trace output vs the forward")
        i = d.pick([0, 1, -1, 7, "a", 1.0, None])
        b = d.pick([None, None, 0, 1, 5])
        attempt("Trace.head", lambda: tr.head(i, b))
        other = d.pick([tr, {"output": tr.output}, {"weights": np.ones(3)}, {"foo": 1},
                        None, "a", {}])
        attempt("Trace.compare", lambda: tr.compare(other))
        if want_w is True and d.chance(6):
            fuzz_plot_weights(d, rng, tr.weights)


def fuzz_plot_weights(d: Data, rng, weights):
    import mhattn
    kw = {}
    T = weights.shape[-2] if isinstance(weights, np.ndarray) and weights.ndim >= 2 else 3
    if d.chance(3):
        kw["tokens"] = hostile(d, [str(i) for i in range(T)], 4)
    if d.chance(3):
        kw["heads"] = d.pick([0, 1, 5, [0], [], "a", 1.0, -1])
    if d.chance(4):
        kw["batch"] = d.pick([0, 1, 3, -1, "a"])
    if d.chance(4):
        kw["kind"] = d.pick(["weights", "scores", "nope"])
    if d.chance(4):
        kw["vmax"] = d.pick([None, "auto", 1.0, "nope", np.nan])
    if d.chance(4):
        kw[d.pick(["mask", "key_lengths", "window", "key_mask", "causal"])] = d.pick(
            [np.ones((2, 2), bool), 9, (-1, 0), np.ones(2, bool), 1, True, None])
    if d.chance(4):
        kw["annotate"] = bool(d.int(0, 1))
    attempt("plot_attention", lambda: mhattn.plot_attention(hostile(d, weights, 6), **kw))


def fuzz_plot(d: Data, rng):
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        return
    import mhattn
    x = vals(rng, (d.int(1, 3), 4))
    w = np.eye(4)
    _, wt = mhattn.multi_head_attention(x, w, w, w, num_heads=d.pick([1, 2]),
                                        causal=bool(d.int(0, 1)), return_weights=True)
    fuzz_plot_weights(d, rng, wt)


def fuzz_rope(d: Data, rng):
    import mhattn
    kw = {}
    if d.chance(2):
        kw["theta"] = d.pick([10.0, 1e4, 1.0, 0.0, -1.0, np.nan, np.inf, "a", True, 10])
    if d.chance(2):
        kw["rotary_dim"] = d.pick([None, 2, 4, 3, 0, -2, 2.0, "a", 2 ** 40])
    if d.chance(3):
        kw["interleaved"] = d.pick([True, False, 1, "yes", np.bool_(True)])
    if d.chance(3):
        kw["inv_freq"] = hostile(d, rng.random(d.int(0, 3)), 3)
    rope = attempt("RoPE", lambda: mhattn.RoPE(**kw))
    if rope is RAISED:
        return
    x = vals(rng, (3, 4))
    attempt("multi_head_attention", lambda: mhattn.multi_head_attention(
        x, np.eye(4), np.eye(4), np.eye(4), num_heads=d.pick([1, 2]), rope=rope))


def fuzz_layer(d: Data, rng):
    import mhattn
    kw = dict(d_model=d.int(1, 6), num_heads=d.int(1, 3))
    for name, choices in (("num_kv_heads", [1, 2, 3, 0]), ("d_k", [1, 2, 3, 0]),
                          ("d_out", [1, 5, 0]), ("bias", [True, False, "yes"]),
                          ("sinks", [True, False, 1]), ("qk_norm", [True, "per_head", "x"]),
                          ("dtype", [np.float32, np.float64, np.int32, "abc"]),
                          ("seed", [0, 1, None]), ("norm_eps", [1e-6, 0.0])):
        if d.chance(5):
            kw[name] = d.pick(choices)
    for name in ("d_model", "num_heads"):
        kw[name] = hostile(d, kw[name], 10)
    layer = attempt("MultiHeadAttention", lambda: mhattn.MultiHeadAttention(**kw))
    if layer is RAISED:
        return
    x = vals(rng, (d.int(1, 2), d.int(1, 4), int(kw["d_model"])), layer.w_q.dtype)
    opts = dict(causal=bool(d.int(0, 1)))
    if d.chance(4):
        opts[d.pick(["window", "softcap", "mask", "foo", "w_q", "key"])] = d.pick(
            [(1, 0), 5.0, np.ones((2, 2), bool), 1, None, np.ones((2, 3))])
    got = attempt("MultiHeadAttention.__call__",
                  lambda: layer(hostile(d, x, 8), return_context=True, **opts))
    if got is not RAISED:
        g = hostile(d, vals(rng, got[0].shape, got[0].dtype), 8)
        attempt("MultiHeadAttention.backward", lambda: layer.backward(g, got[1]))
    state = {k: hostile(d, v, 4) for k, v in layer.state_dict().items()}
    if d.rarely(6):
        state = d.pick([None, {}, "abc", dict(state, foo=np.ones(2))])
    before = {k: v.copy() for k, v in layer.state_dict().items()}
    if attempt("MultiHeadAttention.load_state_dict",
               lambda: layer.load_state_dict(state)) is RAISED:
        for k, v in layer.state_dict().items():
            if not np.array_equal(v, before[k], equal_nan=True):
                raise Finding("load_state_dict raised but changed the layer")


def _prototype(kind):
    """A learner's prototype: correct, or a known mistake, or misbehaving."""
    def fn(x, w_q, w_k, w_v, w_o, num_heads):
        d_k, d_v = w_q.shape[1] // num_heads, w_v.shape[1] // num_heads
        heads = []
        for i in range(num_heads):
            q = x @ w_q[:, i * d_k:(i + 1) * d_k]
            k = x @ w_k[:, i * d_k:(i + 1) * d_k]
            v = x @ w_v[:, i * d_v:(i + 1) * d_v]
            s = q @ k.T / (np.sqrt(d_k) if kind != "no_scaling" else 1.0)
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            p = e / e.sum(axis=-1 if kind != "softmax_wrong_axis" else 0, keepdims=True)
            heads.append(p @ v)
        out = np.concatenate(heads, axis=-1) @ w_o
        return {"raises": lambda: 1 / 0, "junk": lambda: "junk",
                "shape": lambda: out[:, :1]}.get(kind, lambda: out)()
    return fn


def _attention_prototype(kind):
    def fn(q, k, v, mask=None):
        s = q @ np.swapaxes(k, -1, -2) / (np.sqrt(q.shape[-1]) if kind != "no_scaling" else 1)
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        axis = -1 if kind != "softmax_wrong_axis" else -2
        top = s.max(axis=axis, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(top), top, 0))
        total = e.sum(axis=axis, keepdims=True)
        out = np.where(total > 0, e / np.where(total > 0, total, 1), 0) @ v   # masked row: 0
        return {"raises": lambda: 1 / 0, "junk": lambda: None,
                "shape": lambda: out[..., :1]}.get(kind, lambda: out)()
    return fn


def fuzz_checker(d: Data, rng):
    import mhattn
    kind = d.pick(["correct", "correct", "no_scaling", "softmax_wrong_axis", "raises", "junk",
                   "shape"])
    attention = d.chance(2)
    fn = (_attention_prototype if attention else _prototype)(kind)
    kw = dict(trials=hostile(d, d.int(0, 1), 8), seed=d.int(0, 5),
              dtype=hostile(d, d.pick([np.float64, np.float32]), 8))
    if not attention and d.chance(3):
        kw["convention"] = d.pick(["general", "standard", "nope"])
    check = mhattn.check_attention_prototype if attention else mhattn.check_prototype
    name = "check_attention_prototype" if attention else "check_prototype"
    report = attempt(name, lambda: check(hostile(d, fn, 10), **kw))
    if report is RAISED or not callable(fn):
        return
    if kind == "correct" and not report.ok and kw["dtype"] is np.float64:
        raise Finding(f"{name}: a correct prototype fails: {report.title}")
    if kind != "correct" and report.ok:
        raise Finding(f"{name}: a {kind} prototype passes")


def fuzz_small(d: Data, rng):
    """The PyTorch mask converters, param_count and set_num_threads."""
    import mhattn
    which = d.int(0, 3)
    if which == 0:
        T, B, h = d.int(1, 3), d.int(1, 2), d.int(1, 2)
        am = hostile(d, d.pick([rng.random((T, T)) > 0.3, vals(rng, (B * h, T, T)), None]), 4)
        kpm = hostile(d, d.pick([None, rng.random((B, T)) > 0.3]), 4)
        attempt("from_torch_masks", lambda: mhattn.from_torch_masks(
            am, kpm, num_heads=hostile(d, h, 6), batch_size=d.pick([None, B, 0])))
    elif which == 1:
        m = hostile(d, rng.random(tuple(d.int(1, 2) for _ in range(d.int(1, 4)))) > 0.3, 4)
        attempt("to_torch_attn_mask", lambda: mhattn.to_torch_attn_mask(
            m, num_heads=d.pick([None, 1, 2, "a"]), batch_size=d.pick([None, 1, 2]),
            tgt_len=d.pick([None, 1, 2]), src_len=d.pick([None, 2])))
    elif which == 2:
        args = [hostile(d, d.int(1, 8), 4), hostile(d, d.int(1, 4), 4)]
        attempt("param_count", lambda: mhattn.param_count(
            *args, d_k=d.pick([None, 2, 0, "a"]), d_v=d.pick([None, 3, -1])))
    else:
        before = mhattn.get_num_threads()
        n = d.pick([-1, "a", 2.0, True, [1], None, 0, 1])
        try:
            attempt("set_num_threads", lambda: mhattn.set_num_threads(n))
        finally:
            mhattn.set_num_threads(before)


def fuzz_block_mask(d: Data, rng):
    """BlockMask from a (sometimes hostile) function or a dense mask, then
    attention with it against the same call with its dense mask, bit for
    bit (issue 39)."""
    import mhattn
    kw, s = projected(d, rng)
    Tq, Tk, H = s["Tq"], s["Tk"], s["H"]
    block = hostile(d, (d.int(1, 6), d.int(1, 6)), 10)
    bh = d.pick([1, H, H + 1])
    dense = rng.random((d.pick([1, s["B"]]), bh, Tq, Tk)) < d.pick([0.0, 0.3, 0.8, 1.0])
    how = d.int(0, 3)
    if how == 0:
        bm = attempt("BlockMask.from_dense",
                     lambda: mhattn.BlockMask.from_dense(hostile(d, dense, 6), block=block))
    else:
        wrong = [lambda b, h, q, kv: dense[b % dense.shape[0], h % bh, q, kv],
                 lambda b, h, q, kv: (q - kv).astype(d.pick([np.int64, np.float32])),
                 lambda b, h, q, kv: dense[0, 0, :, :-1] if Tk else 1 / 0,
                 lambda b, h, q, kv: d.pick(GARBAGE)]
        fn = wrong[0] if d.chance(2) else d.pick(wrong)
        bm = attempt("BlockMask.from_function", lambda: mhattn.BlockMask.from_function(
            fn, dense.shape[0], bh, Tq, Tk, block=block))
    if bm is RAISED:
        return
    if not np.array_equal(bm.to_dense(), np.broadcast_to(bm.to_dense(), bm.shape)):
        raise Finding("BlockMask.to_dense: not of its shape")
    got = attempt("attention", lambda: mhattn.attention(**kw, block_mask=bm))
    if got is RAISED:
        return
    full = bm.to_dense()
    want = mhattn.attention(**kw, mask=full if s["lead"] else full[0])
    if not np.array_equal(got, want, equal_nan=True):
        raise Finding("attention(block_mask=) differs from its dense mask's bits")


def fuzz_paged(d: Data, rng):
    """PagedKVCache: its constructor, add_sequence, append, free and
    attention, the pool's pages counted after every step, each decode
    against attention on the sequence's keys held contiguously (issue 39)."""
    import mhattn
    G, group, dk = d.int(1, 2), d.int(1, 2), d.int(1, 3)
    ps, n = hostile(d, d.int(1, 5), 10), hostile(d, d.int(1, 12), 10)
    cache = attempt("PagedKVCache", lambda: mhattn.PagedKVCache(n, ps, G, dk,
                                                                dtype=np.float64))
    if cache is RAISED:
        return
    held = {}                          # id -> (keys, values) appended
    for _ in range(d.int(1, 6)):
        op = d.int(0, 3)
        if op == 0 or not held:
            sid = cache.add_sequence()
            held[sid] = (np.zeros((G, 0, dk)), np.zeros((G, 0, dk)))
            continue
        ids = list(held)[:d.int(1, len(held))]
        if op == 1:
            T = d.int(0, 3)
            k, v = (hostile(d, vals(rng, (len(ids), G, T, dk)), 12) for _ in range(2))
            before = cache.pages_in_use
            if attempt("PagedKVCache.append", lambda: cache.append(
                    hostile(d, ids, 12), k, v)) is RAISED:
                if cache.pages_in_use != before:
                    raise Finding("PagedKVCache.append raised but changed the pool")
                continue
            # What a float64 cache holds of rows it took (a half or integer
            # dtype's values are exact in float64).
            k, v = (np.asarray(a).astype(np.float64) for a in (k, v))
            for i, sid in enumerate(ids):
                held[sid] = tuple(np.concatenate([h, a[i]], axis=1)
                                  for h, a in zip(held[sid], (k, v)))
        elif op == 2:
            sid = ids[0]
            attempt("PagedKVCache.free", lambda: cache.free(hostile(d, sid, 12)))
            if sid in cache.sequences:
                continue
            del held[sid]
        else:
            q = vals(rng, (len(ids), G * group, 1, dk))
            out = attempt("attention", lambda: mhattn.attention(
                q, cache=cache, sequence_ids=hostile(d, ids, 12)))
            if out is RAISED:
                continue
            for i, sid in enumerate(ids):
                k, v = held[sid]
                if k.shape[1] == 0:
                    continue
                want = mhattn.attention(q[i:i + 1], k[None], v[None])
                close(out[i:i + 1], want, "PagedKVCache attention")
        used = sum(-(-held[s_][0].shape[1] // cache.page_size) for s_ in held)
        if cache.pages_in_use != used:
            raise Finding(f"PagedKVCache: {cache.pages_in_use} pages in use, its sequences "
                          f"hold {used}")


# The first byte's choice (fuzz_grad_and_trace twice: it serves three entry
# points; fuzz_plot, the slowest, once; issue 39's BlockMask and PagedKVCache
# last).
ENTRIES = [fuzz_attention, fuzz_attention_grad, fuzz_merge, fuzz_cache, fuzz_cached_step,
           fuzz_packed, fuzz_grad_and_trace, fuzz_grad_and_trace, fuzz_rope, fuzz_layer,
           fuzz_checker, fuzz_small, fuzz_plot, fuzz_block_mask, fuzz_paged]


# --- the properties -------------------------------------------------------------
RAISED = object()      # what attempt returns for an error the entry point may raise


def attempt(entry: str, call):
    """call(), or RAISED when it raised an error it may raise; anything
    else escapes (a finding)."""
    try:
        return call()
    except ALLOWED as e:
        if NAMES and isinstance(e, (TypeError, ValueError)) and not NAME_RE.match(str(e)):
            raise Finding(f"{entry}: {type(e).__name__} does not name the argument: "
                          f"{str(e)[:300]!r}") from e
        return RAISED
    except IndexError as e:
        if INDEX_OK.match(str(e)) or known(entry, e):
            return RAISED
        raise
    except Exception as e:   # noqa: BLE001 - a known escape, or re-raised
        if known(entry, e):
            return RAISED
        raise


def known(entry: str, e: BaseException) -> bool:
    return any(entry == k and isinstance(e, t) and re.search(p, str(e)) for k, t, p in KNOWN)


def test_one_input(data: bytes) -> None:
    d = Data(data)
    entry = ENTRIES[d.int(0, len(ENTRIES) - 1)]
    rng = np.random.default_rng(d.int(0, 2 ** 16 - 1))
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        entry(d, rng)


TestOneInput = test_one_input


def main(argv):
    run_harness(argv, test_one_input)   # fuzz_mha's replay / atheris driver


if __name__ == "__main__":
    main(sys.argv)
