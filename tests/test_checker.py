"""mhattn.check_prototype: a learner's prototype, checked and diagnosed.

Each buggy prototype below is written the way a learner would write it, from
the document's code, with exactly one mistake; the checker must name it.
They are written independently of the checker's own re-enactments.
"""
import numpy as np
import pytest

import mhattn
from mhattn.learn.checker import MISTAKES, VARIANTS, PrototypeReport


# ------------------------------------------------------------ correct ones

def proto_correct(x, w_q, w_k, w_v, w_o, num_heads):
    """The document's head() generalised to every query row, one head at a time."""
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        Q = x @ w_q[:, i * d_k:(i + 1) * d_k]
        K = x @ w_k[:, i * d_k:(i + 1) * d_k]
        V = x @ w_v[:, i * d_v:(i + 1) * d_v]
        scores = (Q @ K.T) / np.sqrt(d_k)
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        w = w / w.sum(axis=1, keepdims=True)
        heads.append(w @ V)
    z = np.concatenate(heads, axis=1)
    return z @ w_o


def proto_correct_vectorised(x, w_q, w_k, w_v, w_o, num_heads):
    T = x.shape[0]
    h = num_heads
    Q = (x @ w_q).reshape(T, h, -1).transpose(1, 0, 2)   # (h, T, d_k)
    K = (x @ w_k).reshape(T, h, -1).transpose(1, 0, 2)
    V = (x @ w_v).reshape(T, h, -1).transpose(1, 0, 2)   # (h, T, d_v)
    s = Q @ K.transpose(0, 2, 1) / np.sqrt(Q.shape[-1])
    s = s - s.max(axis=-1, keepdims=True)
    a = np.exp(s) / np.exp(s).sum(axis=-1, keepdims=True)
    o = a @ V
    return o.transpose(1, 0, 2).reshape(T, -1) @ w_o


# ------------------------------------------------------------ one bug each

def _per_head(x, w_q, w_k, w_v, num_heads, i):
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    return (x @ w_q[:, i * d_k:(i + 1) * d_k], x @ w_k[:, i * d_k:(i + 1) * d_k],
            x @ w_v[:, i * d_v:(i + 1) * d_v])


def _softmax_rows(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def proto_no_scaling(x, w_q, w_k, w_v, w_o, num_heads):
    heads = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        scores = Q @ K.T                                   # BUG: no / sqrt(d_k)
        heads.append(_softmax_rows(scores) @ V)
    return np.concatenate(heads, axis=-1) @ w_o


def proto_scale_by_dk(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        scores = Q @ K.T / d_k                             # BUG: d_k, not sqrt(d_k)
        heads.append(_softmax_rows(scores) @ V)
    return np.concatenate(heads, axis=-1) @ w_o


def proto_scale_by_sqrt_dmodel(x, w_q, w_k, w_v, w_o, num_heads):
    d_model = x.shape[-1]
    heads = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        scores = Q @ K.T / np.sqrt(d_model)                # BUG: d_model, not d_k
        heads.append(_softmax_rows(scores) @ V)
    return np.concatenate(heads, axis=-1) @ w_o


def proto_softmax_wrong_axis(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        scores = Q @ K.T / np.sqrt(d_k)
        w = np.exp(scores - scores.max(axis=0))            # BUG: axis 0 (queries)
        w = w / w.sum(axis=0)
        heads.append(w @ V)
    return np.concatenate(heads, axis=-1) @ w_o


def proto_heads_averaged(x, w_q, w_k, w_v, w_o, num_heads):
    # "run h times to get h answers, then average them" (active recall 6)
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    answers = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        head = _softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V
        answers.append(head @ w_o[i * d_v:(i + 1) * d_v])
    return np.mean(answers, axis=0)                        # BUG: mean, not sum/concat


def proto_heads_averaged_no_wo(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        heads.append(_softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V)
    return sum(heads) / len(heads)                         # BUG: the average of heads


def proto_heads_summed(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    z = 0
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        z = z + _softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V  # BUG: summed, not concatenated
    return z @ w_o[:d_v]


def proto_heads_summed_no_wo(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    heads = [_softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V
             for Q, K, V in (_per_head(x, w_q, w_k, w_v, num_heads, i)
                             for i in range(num_heads))]
    return np.stack(heads).sum(axis=0)                     # BUG: the sum of heads


def proto_wo_skipped(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        heads.append(_softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V)
    return np.concatenate(heads, axis=-1)                  # BUG: forgot @ w_o


def proto_wo_transposed(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        heads.append(_softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V)
    z = np.concatenate(heads, axis=-1)
    return (w_o @ z.T).T                                   # BUG: W^O transposed


def proto_projections_transposed(x, w_q, w_k, w_v, w_o, num_heads):
    # nn.Linear habit: y = x W^T
    T, h = x.shape[0], num_heads
    Q = (x @ w_q.T).reshape(T, h, -1).transpose(1, 0, 2)   # BUG: .T on every projection
    K = (x @ w_k.T).reshape(T, h, -1).transpose(1, 0, 2)
    V = (x @ w_v.T).reshape(T, h, -1).transpose(1, 0, 2)
    s = Q @ K.transpose(0, 2, 1) / np.sqrt(w_q.shape[1] // h)
    o = _softmax_rows(s) @ V
    return o.transpose(1, 0, 2).reshape(T, -1) @ w_o


def proto_no_max_subtraction(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    heads = []
    for i in range(num_heads):
        Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
        scores = Q @ K.T / np.sqrt(d_k)
        w = np.exp(scores)                                 # BUG: no max subtraction
        w /= w.sum(axis=-1, keepdims=True)
        heads.append(w @ V)
    return np.concatenate(heads, axis=-1) @ w_o


def proto_heads_split_sequence(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    Qs = np.split(x @ w_q, num_heads)                      # BUG: np.split's axis=0 = tokens
    Ks = np.split(x @ w_k, num_heads)
    Vs = np.split(x @ w_v, num_heads)
    heads = [_softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V for Q, K, V in zip(Qs, Ks, Vs)]
    return np.concatenate(heads) @ w_o


def proto_heads_split_sequence_reshape(x, w_q, w_k, w_v, w_o, num_heads):
    T, h = x.shape[0], num_heads
    Q = (x @ w_q).reshape(h, T, -1)                        # BUG: no transpose
    K = (x @ w_k).reshape(h, T, -1)
    V = (x @ w_v).reshape(h, T, -1)
    s = Q @ np.swapaxes(K, 1, 2) / np.sqrt(Q.shape[2])
    return (_softmax_rows(s) @ V).reshape(T, -1) @ w_o


def proto_same_projection_every_head(x, w_q, w_k, w_v, w_o, num_heads):
    d_k = w_q.shape[1] // num_heads
    d_v = w_v.shape[1] // num_heads
    heads = []
    for i in range(num_heads):  # noqa: B007 (the learner never uses i: that's the bug)
        Q = x @ w_q[:, :d_k]                               # BUG: forgot the head index
        K = x @ w_k[:, :d_k]
        V = x @ w_v[:, :d_v]
        heads.append(_softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V)
    return np.concatenate(heads, axis=-1) @ w_o


BUGGY = [
    ("no_scaling", proto_no_scaling),
    ("scale_by_dk", proto_scale_by_dk),
    ("scale_by_sqrt_dmodel", proto_scale_by_sqrt_dmodel),
    ("softmax_wrong_axis", proto_softmax_wrong_axis),
    ("heads_averaged", proto_heads_averaged),
    ("heads_averaged", proto_heads_averaged_no_wo),
    ("heads_summed", proto_heads_summed),
    ("heads_summed", proto_heads_summed_no_wo),
    ("wo_skipped", proto_wo_skipped),
    ("wo_transposed", proto_wo_transposed),
    ("projections_transposed", proto_projections_transposed),
    ("no_max_subtraction", proto_no_max_subtraction),
    ("heads_split_sequence", proto_heads_split_sequence),
    ("heads_split_sequence", proto_heads_split_sequence_reshape),
    ("same_projection_every_head", proto_same_projection_every_head),
]


def test_every_mistake_has_a_buggy_prototype():
    assert {m for m, _ in BUGGY} <= set(MISTAKES)
    keyword_only = {"mask_inverted", "mask_after_softmax", "causal_top_left", "rope_on_v",
                    "rope_pairing_wrong", "softcap_after_mask", "sink_in_numerator",
                    "rope_not_offset", "qk_norm_whole_row", "qk_norm_no_weight",
                    "qk_norm_layernorm", "mask_large_negative", "causal_blocks_self",
                    "causal_sees_next"}
    assert {m for m, _, _ in VARIANTS} == set(MISTAKES) - keyword_only


@pytest.mark.parametrize("fn", [proto_correct, proto_correct_vectorised])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_correct_prototype_is_ok(fn, dtype):
    rep = mhattn.check_prototype(fn, dtype=dtype)
    assert isinstance(rep, PrototypeReport)
    assert rep.ok, str(rep)
    assert rep.mistake is None
    assert all(t.ok for t in rep.trials)
    assert "OK" in str(rep) and "agrees with mhattn" in rep.explanation
    assert "OK" in rep._repr_html_()


@pytest.mark.parametrize("mistake,fn", BUGGY, ids=[f.__name__[6:] for _, f in BUGGY])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_buggy_prototype_is_diagnosed(mistake, fn, dtype):
    rep = mhattn.check_prototype(fn, dtype=dtype)
    assert not rep.ok
    assert rep.mistake == mistake, str(rep)
    assert rep.exact and rep.candidates == [mistake], str(rep)
    text = str(rep)
    assert mistake in text and MISTAKES[mistake][0] in text
    assert rep.explanation in text
    assert mistake in rep._repr_html_() and "<table" in rep._repr_html_()
    assert repr(rep) == text


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("mistake,fn", BUGGY[:6] + BUGGY[9:13],
                         ids=[f.__name__[6:] for _, f in BUGGY[:6] + BUGGY[9:13]])
def test_diagnosis_holds_for_other_seeds_and_trials(mistake, fn, seed):
    rep = mhattn.check_prototype(fn, seed=seed, trials=seed * 2)
    assert rep.mistake == mistake, str(rep)
    assert len(rep.trials) == 5 + seed * 2


def test_variants_are_pairwise_distinguishable():
    """On the designed trials alone, no two mistakes give the same outputs."""
    from mhattn.learn.checker import _distance, _reenact, _run, _trials
    for dtype, tol in ((np.float64, 1e-7), (np.float32, 2e-4)):
        cases = _trials(0, np.dtype(dtype), 0)
        outs = {}
        for mistake, form, vfn in VARIANTS:
            outs[(mistake, form)] = [_run(vfn, t.args)[0] for t in cases]
        outs[("correct", "")] = [_reenact(t.args) for t in cases]
        keys = list(outs)
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                if a[0] == b[0]:
                    continue
                if "wo_cut_to_fit" in (a[0], b[0]) and "correct" in (a[0], b[0]):
                    continue    # shows only after another mistake narrows Concat
                same = all(_distance(x, y, tol)[0] for x, y in zip(outs[a], outs[b]))
                assert not same, (dtype, a, b)


def test_trial_set_covers_the_shapes_where_bugs_show():
    from mhattn.learn.checker import _reenact, _trials
    cases = _trials(0, np.dtype(np.float64), 0)
    names = [t.name for t in cases]
    assert names[0] == "worked_example"
    dims = [t.dims for t in cases]
    assert any(d["d_k"] != d["d_v"] for d in dims)
    assert any(d["h"] > 2 for d in dims)
    assert all(d["T"] >= 3 for d in dims)
    assert any(d["h"] * d["d_v"] != d["d_out"] for d in dims)       # non-square W^O
    assert any(d["h"] * d["d_v"] == d["d_out"] for d in dims)       # square W^O
    assert any(d["d_model"] == d["h"] * d["d_k"] == d["h"] * d["d_v"] for d in dims)
    big = [t for t in cases if t.large]
    assert len(big) == 1
    with np.errstate(all="ignore"):
        assert not np.isfinite(_reenact(big[0].args, "no_max_subtraction")).all()
    assert np.isfinite(mhattn.multi_head_attention(*big[0].args[:5], num_heads=2)).all()
    # the worked example is the document's, fused
    we = cases[0]
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    np.testing.assert_array_equal(we.x, X)
    np.testing.assert_array_equal(we.w_q, np.concatenate(w_q, axis=1))
    np.testing.assert_array_equal(we.w_o, np.eye(4))


def test_raising_prototype_records_the_exception():
    def assumes_dk_equals_dv(x, w_q, w_k, w_v, w_o, num_heads):
        d_k = w_q.shape[1] // num_heads
        heads = []
        for i in range(num_heads):
            Q = x @ w_q[:, i * d_k:(i + 1) * d_k]
            K = x @ w_k[:, i * d_k:(i + 1) * d_k]
            V = x @ w_v[:, i * d_k:(i + 1) * d_k]        # d_k used for V too
            heads.append(_softmax_rows(Q @ K.T / np.sqrt(d_k)) @ V)
        return np.concatenate(heads, axis=-1) @ w_o

    rep = mhattn.check_prototype(assumes_dk_equals_dv)
    assert not rep.ok and rep.mistake == "v_sliced_with_dk", str(rep)
    assert rep.exact and rep.candidates == ["v_sliced_with_dk"]
    raised = [t for t in rep.trials if t.status == "raised"]
    assert raised and all("ValueError" in t.error for t in raised)
    dims = {t.name: t for t in rep.trials}
    assert dims["worked_example"].ok
    text = str(rep)
    assert "raised ValueError" in text
    # no transpose makes these shapes fit: no transposed-matrix hint
    assert not any("transposed matrix" in h for h in rep.hints), rep.hints
    assert "d_k != d_v" in text                   # it fails exactly there
    assert rep.standard_ok is True and 'convention="standard"' in text
    assert mhattn.check_prototype(assumes_dk_equals_dv, convention="standard").ok


def test_transposed_hint_only_when_a_transpose_fits():
    def wo_t(x, w_q, w_k, w_v, w_o, num_heads):
        return proto_correct(x, w_q, w_k, w_v, w_o.T, num_heads)

    rep = mhattn.check_prototype(wo_t)
    assert rep.mistake == "wo_transposed"
    raised = [t for t in rep.trials if t.status == "raised"]
    assert raised
    assert any("transposed matrix" in h for h in rep.hints), rep.hints


def test_prototype_raising_everywhere():
    def broken(x, w_q, w_k, w_v, w_o, num_heads):
        return undefined_name  # noqa: F821

    rep = mhattn.check_prototype(broken)
    assert not rep.ok and rep.mistake is None
    assert all(t.status == "raised" and t.error.startswith("NameError") for t in rep.trials)
    assert "NameError" in str(rep)


def test_bad_returns():
    rep = mhattn.check_prototype(lambda *a: None)
    assert not rep.ok and "returned None" in str(rep)
    rep = mhattn.check_prototype(lambda *a: {"weights": 1})
    assert not rep.ok and "'output'" in str(rep)


def test_dict_of_intermediates_names_first_differing_stage():
    def with_steps(x, w_q, w_k, w_v, w_o, num_heads, scale_bug=True):
        h = num_heads
        d_k = w_q.shape[1] // h
        Q = x @ w_q                                      # fused (T, h*d_k)
        scores, weights, heads = [], [], []
        for i in range(h):
            q, k, v = _per_head(x, w_q, w_k, w_v, h, i)
            s = q @ k.T if scale_bug else q @ k.T / np.sqrt(d_k)
            a = _softmax_rows(s)
            scores.append(s)
            weights.append(a)
            heads.append(a @ v)
        z = np.concatenate(heads, axis=-1)
        return {"q": Q, "scores": np.stack(scores), "weights": np.stack(weights),
                "heads": heads, "z": z, "out": z @ w_o}

    rep = mhattn.check_prototype(with_steps)
    assert rep.mistake == "no_scaling"
    assert rep.first_divergent_stage == "scores"
    first = rep.trials[0].stages
    assert first.first_divergence == "scores"
    assert first["q"].ok and first["raw_scores"].ok is None
    assert "'scores'" in str(rep)

    rep = mhattn.check_prototype(lambda *a: with_steps(*a, scale_bug=False))
    assert rep.ok and rep.first_divergent_stage is None


def test_dict_output_right_but_intermediate_named_differently():
    def scores_are_raw(x, w_q, w_k, w_v, w_o, num_heads):
        d_k = w_q.shape[1] // num_heads
        raw = [q @ k.T for q, k, _ in (_per_head(x, w_q, w_k, w_v, num_heads, i)
                                       for i in range(num_heads))]
        return {"scores": np.stack(raw),
                "output": proto_correct(x, w_q, w_k, w_v, w_o, num_heads) + 0 * d_k}

    rep = mhattn.check_prototype(scores_are_raw)
    assert rep.ok
    assert rep.first_divergent_stage == "scores"
    assert "intermediates" in rep.explanation


def test_tuple_return_output_and_weights():
    def returns_pair(x, w_q, w_k, w_v, w_o, num_heads):
        return proto_correct(x, w_q, w_k, w_v, w_o, num_heads), None

    assert mhattn.check_prototype(returns_pair).ok


def test_prototype_cannot_mutate_the_checkers_data():
    def mutates(x, w_q, w_k, w_v, w_o, num_heads):
        out = proto_correct(x, w_q, w_k, w_v, w_o, num_heads)
        x[...] = 0
        w_o[...] = 0
        return out

    assert mhattn.check_prototype(mutates).ok


def test_argument_checks():
    with pytest.raises(TypeError):
        mhattn.check_prototype(42)
    with pytest.raises(TypeError):
        mhattn.check_prototype(proto_correct, dtype=np.int64)
    with pytest.raises(ValueError):
        mhattn.check_prototype(proto_correct, trials=-1)


def test_docstring_carries_signature():
    assert ('check_prototype(fn, *, trials=4, dtype=np.float64, seed=0, '
            'convention="general")') in mhattn.check_prototype.__doc__


# ------------------------------------------------------------ the step model

def test_pair_is_named_with_both_mistakes():
    def classmate(x, w_q, w_k, w_v, w_o, num_heads):
        # "single-head attention run h times, then averaged" (active recall 6)
        d_k = w_q.shape[1] // num_heads
        d_v = w_v.shape[1] // num_heads
        q, k, v = x @ w_q[:, :d_k], x @ w_k[:, :d_k], x @ w_v[:, :d_v]
        answers = [_softmax_rows(q @ k.T / np.sqrt(d_k)) @ v for _ in range(num_heads)]
        return np.mean(answers, axis=0)

    rep = mhattn.check_prototype(classmate)
    assert set(rep.mistakes) == {"same_projection_every_head", "heads_averaged"}, str(rep)
    assert rep.exact and rep.candidates == ["same_projection_every_head + heads_averaged"]
    assert "two mistakes" in rep.title
    for m in rep.mistakes:
        assert MISTAKES[m][1].splitlines()[0] in rep.explanation


def test_weights_transposed_not_confused_with_column_softmax():
    """On the worked example W^Q = W^K, so weights.T looks like a column
    softmax: only candidates that fit every trial are named."""
    def wt(x, w_q, w_k, w_v, w_o, num_heads):
        heads = []
        for i in range(num_heads):
            Q, K, V = _per_head(x, w_q, w_k, w_v, num_heads, i)
            heads.append(_softmax_rows(Q @ K.T / np.sqrt(Q.shape[1])).T @ V)
        return np.concatenate(heads, axis=-1) @ w_o

    rep = mhattn.check_prototype(wt)
    assert rep.mistakes == ("weights_transposed",) and rep.exact
    assert all("softmax_wrong_axis" not in t.matching for t in rep.trials)


def test_exception_matches_only_the_same_operation():
    """A prototype that raises a shape error somewhere no mistake does is
    not matched by a mistake that raises the same type elsewhere."""
    def raises(x, w_q, w_k, w_v, w_o, num_heads):
        if w_o.shape[0] != w_o.shape[1]:
            raise ValueError("matmul: size 997 is different from 991")
        return proto_correct(x, w_q, w_k, w_v, w_o, num_heads)

    rep = mhattn.check_prototype(raises)
    assert rep.mistake is None, str(rep)
    assert "wo_transposed" not in str(rep)
    assert not any("transposed matrix" in h for h in rep.hints)


def test_float32_prototype_is_named_as_float32_rounding():
    def in_f32(x, w_q, w_k, w_v, w_o, num_heads):
        args = [a.astype(np.float32) for a in (x, w_q, w_k, w_v, w_o)]
        return proto_correct(*args, num_heads)

    rep = mhattn.check_prototype(in_f32)
    assert not rep.ok and rep.float32_rounding and rep.mistake is None
    assert "float32 rounding" in rep.explanation
    assert "dtype=np.float32" in rep.explanation
    assert mhattn.check_prototype(in_f32, dtype=np.float32).ok
    # a real mistake is not float32 rounding
    assert not mhattn.check_prototype(proto_no_scaling).float32_rounding


def test_standard_convention():
    def standard_only(x, w_q, w_k, w_v, w_o, num_heads):
        d = x.shape[1] // num_heads                      # assumes d_k = d_v = d_model/h
        T = x.shape[0]
        Q = (x @ w_q).reshape(T, num_heads, d).transpose(1, 0, 2)
        K = (x @ w_k).reshape(T, num_heads, d).transpose(1, 0, 2)
        V = (x @ w_v).reshape(T, num_heads, d).transpose(1, 0, 2)
        o = _softmax_rows(Q @ K.transpose(0, 2, 1) / np.sqrt(d)) @ V
        return o.transpose(1, 0, 2).reshape(T, -1) @ w_o

    rep = mhattn.check_prototype(standard_only, convention="standard")
    assert rep.ok, str(rep)
    assert all(t.dims["d_k"] == t.dims["d_v"] == t.dims["d_model"] // t.dims["h"]
               for t in mhattn.learn.checker._trials(4, np.dtype(np.float64), 0, "standard"))
    rep = mhattn.check_prototype(standard_only)
    assert not rep.ok and rep.standard_ok is True
    assert "passes every trial of the standard convention" in rep.explanation
    assert not mhattn.check_prototype(proto_no_scaling).standard_ok
    with pytest.raises(ValueError):
        mhattn.check_prototype(proto_correct, convention="llama")


def test_paragraphs_keep_the_written_order():
    rep = mhattn.check_prototype(proto_heads_split_sequence)
    kinds = [k for k, _ in rep.paragraphs]
    assert set(kinds) == {"prose", "code"}
    texts = [t for _, t in rep.paragraphs]
    fix = next(i for i, t in enumerate(texts) if t.endswith("Fix (either form):"))
    assert rep.paragraphs[fix + 1][0] == "code"
    assert rep.paragraphs[fix + 2] == ("prose", "not np.split(Q, h, axis=0) or "
                                                "Q.reshape(h, T, d_k).")
    # the paragraphs are the explanation, in order (prose unwrapped)
    flat = " ".join(rep.explanation.split())
    pos = [flat.find(" ".join(t.split())) for t in texts]
    assert -1 not in pos and pos == sorted(pos)
    assert not any(t.startswith("Hint:") for t in texts) and rep.hints
    assert isinstance(rep.hints, list) and all(isinstance(h, str) for h in rep.hints)


def test_mask_keyword_is_passed_only_when_accepted():
    seen = []

    def with_mask(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
        seen.append(mask is not None)
        return mhattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=num_heads,
                                           mask=None if mask is None else ~mask)

    rep = mhattn.check_prototype(with_mask)
    assert any(seen) and rep.mistakes == ("mask_inverted",), str(rep)
    seen.clear()

    def without(x, w_q, w_k, w_v, w_o, num_heads):
        return proto_correct(x, w_q, w_k, w_v, w_o, num_heads)
    assert mhattn.check_prototype(without).ok
    assert not any(t.name == "mask" for t in mhattn.check_prototype(without).trials)


# ------------------------------------------------------------ attention alone

def _attend(q, k, v, mask=None, *, scale=None, axis=-1, post_mask=False, wt=False):
    s = q @ k.transpose(0, 2, 1)
    s = s / np.sqrt(q.shape[-1]) if scale is None else s * scale
    if mask is not None and not post_mask:
        s = np.where(mask, s, -np.inf)
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    w = e / e.sum(axis=axis, keepdims=True)
    if mask is not None and post_mask:
        w = w * mask
    return (w.transpose(0, 2, 1) if wt else w) @ v


def test_check_attention_prototype_correct_and_mistakes():
    assert mhattn.check_attention_prototype(_attend).ok
    assert mhattn.check_attention_prototype(
        lambda q, k, v, mask=None: _attend(q, k, v, mask), dtype=np.float32).ok
    cases = [
        (lambda q, k, v, mask=None: _attend(q, k, v, mask, scale=1.0), ("no_scaling",)),
        (lambda q, k, v, mask=None: _attend(q, k, v, mask, axis=1),
         ("softmax_wrong_axis",)),
        (lambda q, k, v, mask=None: _attend(q, k, v, mask, post_mask=True),
         ("mask_after_softmax",)),
        (lambda q, k, v, mask=None: _attend(q, k, v, None if mask is None else ~mask),
         ("mask_inverted",)),
        (lambda q, k, v, mask=None: _attend(q, k, v, mask, scale=1.0, wt=True),
         ("no_scaling", "weights_transposed")),
    ]
    for fn, expected in cases:
        rep = mhattn.check_attention_prototype(fn)
        assert set(rep.mistakes) == set(expected), str(rep)


def test_check_attention_prototype_causal():
    def top_left(q, k, v, causal=False):
        s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        if causal:
            s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -np.inf)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True) @ v

    rep = mhattn.check_attention_prototype(top_left)
    assert rep.mistakes == ("causal_top_left",), str(rep)
    assert any(t.name == "causal" for t in rep.trials)
    with pytest.raises(TypeError):
        mhattn.check_attention_prototype(3)


# ------------------------------------------------------------ Trace.compare

def test_compare_accepts_aliases_and_lists_unused_keys():
    tokens, X, w_q, w_k, w_v, w_o = mhattn.worked_example()
    wq, wk, wv = (np.concatenate(w, axis=1) for w in (w_q, w_k, w_v))
    tr = mhattn.trace(X, wq, wk, wv, w_o, num_heads=2)
    d = tr.to_dict()
    rep = tr.compare({"attn_output": d["output"], "context": d["concat"],
                      "attention_scores": d["scores"], "softmax": d["weights"],
                      "bogus": 1, "row_max": d["row_max"]})
    assert rep.ok
    for stage in ("output", "concat", "scores", "weights"):
        assert rep[stage].ok is True
    assert rep.unused == ["bogus", "row_max"]
    assert "'bogus'" in rep.summary() and "'row_max'" in str(rep)
    rep = tr.compare({"attention_probs": d["weights"], "scores_scaled": d["scores"],
                      "weights": d["weights"]})
    assert rep["weights"].ok and rep["scores"].ok and rep.unused == ["weights"]
    assert tr.compare({"output": d["output"]}).unused == []
    for alias in ("attn_output", "context", "attention_scores", "attention_probs",
                  "softmax", "scores_scaled"):
        assert alias in mhattn.Trace.compare.__doc__


def _capped(q, k, v, mask=None, softcap=None, sinks=None, *, late=False, num=False):
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    if softcap is not None and not late:
        s = softcap * np.tanh(s / softcap)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    if softcap is not None and late:
        s = softcap * np.tanh(s / softcap)
    if sinks is None:
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True) @ v
    sk = np.asarray(sinks)[:, None, None]
    m = np.maximum(s.max(-1, keepdims=True), sk)
    e, es = np.exp(s - m), np.exp(sk - m)
    return ((e + es) if num else e) / (e.sum(-1, keepdims=True) + es) @ v


def test_check_attention_prototype_softcap_and_sinks():
    assert mhattn.check_attention_prototype(_capped).ok
    rep = mhattn.check_attention_prototype(
        lambda q, k, v, mask=None, softcap=None, sinks=None:
        _capped(q, k, v, mask, softcap, sinks, late=True))
    assert rep.mistakes == ("softcap_after_mask",), str(rep)
    rep = mhattn.check_attention_prototype(
        lambda q, k, v, mask=None, softcap=None, sinks=None:
        _capped(q, k, v, mask, softcap, sinks, num=True))
    assert rep.mistakes == ("sink_in_numerator",), str(rep)
    # a prototype without the keywords is never passed them
    names = [t.name for t in mhattn.check_attention_prototype(_attend).trials]
    assert "softcap" not in names and "sinks" not in names and "mask" in names


def test_misnamed_intermediate_does_not_hide_a_later_mistake():
    def raw_as_scores_and_wo_t(x, w_q, w_k, w_v, w_o, num_heads):
        raw = [q @ k.T for q, k, _ in (_per_head(x, w_q, w_k, w_v, num_heads, i)
                                       for i in range(num_heads))]
        return {"scores": np.stack(raw),          # raw scores under the name 'scores'
                "output": proto_correct(x, w_q, w_k, w_v, w_o.T, num_heads)}

    rep = mhattn.check_prototype(raw_as_scores_and_wo_t)
    assert rep.mistakes == ("wo_transposed",), str(rep)
    assert rep.first_divergent_stage == "scores"
    assert "another quantity under mhattn's name" in rep.explanation


def test_first_divergent_stage_prunes_candidates():
    def scale_dk_with_scores(x, w_q, w_k, w_v, w_o, num_heads):
        d_k = w_q.shape[1] // num_heads
        heads, scores = [], []
        for i in range(num_heads):
            q, k, v = _per_head(x, w_q, w_k, w_v, num_heads, i)
            s = q @ k.T / d_k
            scores.append(s)
            heads.append(_softmax_rows(s) @ v)
        return {"scores": np.stack(scores),
                "output": np.concatenate(heads, axis=-1) @ w_o}

    from mhattn.learn import checker
    seen = []
    real = checker._search

    def spy(steps, starts, user, tol, first_stage, passing=()):
        out = real(steps, starts, user, tol, first_stage, passing)
        seen.append((first_stage, out))
        return out
    checker._search, old = spy, checker._search
    try:
        rep = mhattn.check_prototype(scale_dk_with_scores)
    finally:
        checker._search = old
    assert rep.mistakes == ("scale_by_dk",)
    stage, cands = seen[0]
    assert stage == "scores"
    # nothing after the scores was tried as the first (or only) mistake
    later = {"weights_transposed", "heads_averaged", "wo_skipped", "wo_transposed",
             "softmax_wrong_axis", "heads_wrong_order"}
    assert not any(c.names[0] in later for c in cands)


def test_check_attention_prototype_rope_offset():
    from mhattn.reference import rope as turn

    def make(offset=True, interleaved=None):
        def attend(q, k, v, rope=None):
            if rope is not None:
                tq, tk, d = q.shape[1], k.shape[1], q.shape[2]
                f = 1.0 / rope.theta ** (np.arange(0, d, 2) / d)
                il = rope.interleaved if interleaved is None else interleaved
                qpos = np.arange(tq) + (tk - tq if offset else 0)
                q = np.stack([turn(a, qpos, f, d, il) for a in q])
                k = np.stack([turn(a, np.arange(tk), f, d, il) for a in k])
            return _attend(q, k, v)
        return attend

    assert mhattn.check_attention_prototype(make()).ok
    rep = mhattn.check_attention_prototype(make(offset=False))
    assert rep.mistakes == ("rope_not_offset",), str(rep)
    rep = mhattn.check_attention_prototype(make(interleaved=True))
    assert rep.mistakes == ("rope_pairing_wrong",), str(rep)


def test_qk_norm_mistakes_are_named_and_a_correct_norm_passes():
    """A prototype taking q_norm and k_norm gets a q/k-norm trial; each of
    the norm's three mistakes is named, and the correct norm passes."""
    def make(kind):
        def norm(a, w):
            if kind == "layernorm":
                a = a - a.mean(-1, keepdims=True)
            return a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * (
                1.0 if kind == "no_weight" else w)

        def proto(x, w_q, w_k, w_v, w_o, num_heads, q_norm=None, k_norm=None):
            T, h = len(x), num_heads
            Q, K = x @ w_q, x @ w_k
            if kind == "whole_row":
                Q = Q / np.sqrt((Q * Q).mean(-1, keepdims=True) + 1e-6)
                K = K / np.sqrt((K * K).mean(-1, keepdims=True) + 1e-6)
            q, k = Q.reshape(T, h, -1), K.reshape(T, h, -1)
            v = (x @ w_v).reshape(T, h, -1)
            if q_norm is not None:
                if kind == "whole_row":
                    q, k = q * q_norm, k * k_norm
                else:
                    q, k = norm(q, q_norm), norm(k, k_norm)
            s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            return np.einsum("hqk,khd->qhd", p, v).reshape(T, -1) @ w_o
        return proto

    assert mhattn.check_prototype(make("ok")).ok
    for kind in ("no_weight", "layernorm", "whole_row"):
        rep = mhattn.check_prototype(make(kind))
        assert not rep.ok and rep.mistakes == ("qk_norm_" + kind,), (kind, rep.mistakes)
    # without the keywords the prototype is never passed a norm
    assert "qk_norm" not in [t.name for t in mhattn.check_prototype(
        lambda x, w_q, w_k, w_v, w_o, num_heads: make("ok")(x, w_q, w_k, w_v, w_o,
                                                             num_heads)).trials]


# ------------------------------------------------------------ the mistake table

def test_mistakes_are_one_table_read_by_the_model_and_the_checker():
    from mhattn.learn import mistakes, steps
    ids = [m.id for m in mistakes.TABLE]
    assert list(MISTAKES) == ids and len(set(ids)) == len(ids)
    for m in mistakes.TABLE:
        assert MISTAKES[m.id] == (m.title, m.text)
        assert m.fix and all(("    " + line) in m.text for line in m.fix.split("\n"))
    # every form is produced by some model with every feature, and nothing else is
    produced = set()
    for model in mistakes.MODELS:
        for step in steps.build_model(model, mistakes.FEATURES):
            for name, written, fn in step.wrong:
                produced.add((name, step.name, fn.__name__, written))
    table = {(m.id, f.step, f.fn, f.written) for m in mistakes.TABLE for f in m.produce}
    assert produced == table
    # a form's features decide when it is tried
    plain = {n for s in steps.build_model("attention") for n, _, _ in s.wrong}
    assert "causal_top_left" not in plain and "no_scaling" in plain
    causal = {n for s in steps.build_model("attention", ["causal", "masked"])
              for n, _, _ in s.wrong}
    assert "causal_top_left" in causal


def test_two_mistakes_in_the_softmax_are_both_named():
    """The softmax is two steps (row max, normalisation): a prototype that
    forgets the max and normalises over the wrong axis has both named."""
    def attend(q, k, v, mask=None):
        s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        e = np.exp(s)
        return e / e.sum(axis=1, keepdims=True) @ v

    rep = mhattn.check_attention_prototype(attend)
    assert set(rep.mistakes) == {"no_max_subtraction", "softmax_wrong_axis"}, str(rep)
    assert rep.exact and "two mistakes" in rep.title
