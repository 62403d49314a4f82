"""mhattn against the real attention modules of Hugging Face transformers.

Each case builds one attention module of a tiny random model (eager
attention, float64), runs it, and compares its output with
mhattn.reference.multi_head_attention and mhattn.multi_head_attention, and
torch autograd's gradients with mhattn.multi_head_attention_grad.

Float64 throughout.  HF's eager code rounds to float32 in three places even
for a float64 module: the softmax (``softmax(..., dtype=torch.float32)``),
the rotary tables (``position_ids.float() * inv_freq.float()``) and Qwen3's
RMSNorm (``hidden_states.to(torch.float32)``).  The float64 runs undo
exactly those three: the softmax keeps its input's dtype, the (cos, sin)
tables are HF's own formula evaluated in float64 from the module's
``inv_freq`` and ``attention_scaling``, and Qwen3RMSNorm runs its own
formula without the float32 round trip.  ``test_shipped_hf_agrees`` runs
the modules exactly as shipped, to float32 accuracy, so that these three
changes cannot hide a difference in meaning.
"""
import contextlib
from dataclasses import dataclass
from typing import Callable, Optional
from unittest import mock

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import mhattn                                           # noqa: E402
from mhattn import reference as R                       # noqa: E402
from transformers.masking_utils import (create_causal_mask,   # noqa: E402
                                        create_sliding_window_causal_mask)

B, T, D, H, G, HD = 2, 7, 32, 4, 2, 8

# float64 against float64: the sums are short, so rounding stays far below this.
FWD = dict(rtol=1e-9, atol=1e-12)
GRAD_RTOL = 1e-9


def _np(t) -> np.ndarray:
    return np.ascontiguousarray(t.detach().numpy())


def _config(cls, **extra):
    kw = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=G, head_dim=HD,
              num_hidden_layers=1, vocab_size=16, intermediate_size=16,
              max_position_embeddings=64)
    kw.update(extra)
    config = cls(**kw)
    config._attn_implementation = "eager"
    return config


@contextlib.contextmanager
def _float64_throughout():
    """HF's float32 round trips off (see the module docstring)."""
    softmax = torch.nn.functional.softmax

    def softmax64(input, dim=None, _stacklevel=3, dtype=None):
        if dtype == torch.float32 and input.dtype == torch.float64:
            dtype = None
        return softmax(input, dim=dim, dtype=dtype)

    patches = [mock.patch.object(torch.nn.functional, "softmax", softmax64)]
    try:
        from transformers.models.qwen3 import modeling_qwen3

        def rms_norm64(self, hidden_states):          # Qwen3RMSNorm.forward, minus .to(float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
        patches.append(mock.patch.object(modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm64))
    except ImportError:
        pass
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def _tables(rotary, x, position_ids, shipped, halves=True):
    """(cos, sin) for apply_rotary_pos_emb: the rotary module's own forward
    when shipped, else its formula in float64."""
    if shipped:
        return rotary(x, position_ids)
    freqs = position_ids[..., None].to(torch.float64) * rotary.inv_freq.to(torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1) if halves else freqs
    return emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling


@dataclass
class Case:
    """One HF attention module and the mhattn call that should equal it."""
    x: np.ndarray                    # mhattn's x: (B, T, D), or (total, D) when packed
    hf: Callable                     # hf(x tensor of x's shape, shipped) -> (out, weights)
    kw: dict                         # mhattn's arguments besides x (weights included)
    params: dict                     # grad name -> (torch parameter, grad -> mhattn form)
    essential: tuple                 # keywords whose removal must change the answer
    rows: Optional[np.ndarray] = None   # rows of out HF defines (None: all)


def _linear(attn):
    """mhattn weights and gradient maps of q_proj, k_proj, v_proj, o_proj."""
    kw, params = {}, {}
    for name, lin in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj),
                      ("o", attn.o_proj)):
        kw[f"w_{name}"] = _np(lin.weight).T          # nn.Linear keeps (out, in)
        params[f"w_{name}"] = (lin.weight, lambda g: g.T)
        if lin.bias is not None:
            kw[f"b_{name}"] = _np(lin.bias)
            params[f"b_{name}"] = (lin.bias, lambda g: g)
    kw.update(num_heads=H, num_kv_heads=G)
    return kw, params


def _x(seed=0, scale=1.0, shape=(B, T, D)):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def _positions(batch=B):
    return torch.arange(T)[None].expand(batch, T)


def _rope_model(module_cls, rotary_cls, config, *, sliding=False, x_scale=1.0,
                halves=True, setup=None):
    """A Llama-shaped attention module (q/k/v/o_proj, RoPE) on a causal batch."""
    torch.manual_seed(0)
    attn = module_cls(config, 0).double().eval()
    rotary = rotary_cls(config).double()
    if setup is not None:
        setup(attn)
    x = _x(scale=x_scale)
    pos = _positions()
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask

    def hf(xt, shipped):
        mask = make_mask(config=config, inputs_embeds=xt, attention_mask=None, cache=None,
                         position_ids=pos)
        return attn(xt, position_embeddings=_tables(rotary, xt, pos, shipped, halves),
                    attention_mask=mask)
    kw, params = _linear(attn)
    kw.update(causal=True, rope=mhattn.RoPE(inv_freq=_np(rotary.inv_freq)))
    scaling = float(rotary.attention_scaling)
    if scaling != 1.0:
        # cos and sin both carry attention_scaling: q and k are scaled by it.
        kw["scale"] = attn.scaling * scaling ** 2
    return attn, rotary, x, hf, kw, params


def _llama():
    from transformers.models.llama import modeling_llama as m
    config = _config(transformers.LlamaConfig, attention_bias=True)
    attn, rotary, x, hf, kw, params = _rope_model(m.LlamaAttention, m.LlamaRotaryEmbedding,
                                                  config)
    return Case(x, hf, kw, params, essential=("rope",))


def _mistral():
    from transformers.models.mistral import modeling_mistral as m
    config = _config(transformers.MistralConfig, sliding_window=3)
    attn, rotary, x, hf, kw, params = _rope_model(m.MistralAttention, m.MistralRotaryEmbedding,
                                                  config, sliding=True)
    kw["window"] = (config.sliding_window - 1, 0)
    return Case(x, hf, kw, params, essential=("window", "rope"))


def _gemma2():
    from transformers.models.gemma2 import modeling_gemma2 as m
    config = _config(transformers.Gemma2Config, sliding_window=3, query_pre_attn_scalar=12,
                     attn_logit_softcapping=0.8, layer_types=["sliding_attention"])
    attn, rotary, x, hf, kw, params = _rope_model(m.Gemma2Attention, m.Gemma2RotaryEmbedding,
                                                  config, sliding=True, x_scale=3.0)
    kw.update(window=(config.sliding_window - 1, 0), softcap=config.attn_logit_softcapping,
              scale=config.query_pre_attn_scalar ** -0.5)
    return Case(x, hf, kw, params, essential=("window", "softcap", "scale", "rope"))


def _gpt_oss():
    m = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    # max_position_embeddings: YaRN's factor 32 times its original 4096, as shipped.
    config = _config(GptOssConfig, sliding_window=3, layer_types=["sliding_attention"],
                     max_position_embeddings=131072,
                     num_local_experts=2, num_experts_per_tok=1)

    def setup(attn):
        torch.nn.init.normal_(attn.sinks)             # torch.empty until a checkpoint loads
    attn, rotary, x, hf, kw, params = _rope_model(m.GptOssAttention, m.GptOssRotaryEmbedding,
                                                  config, sliding=True, halves=False,
                                                  setup=setup)
    kw.update(window=(config.sliding_window - 1, 0), sinks=_np(attn.sinks))
    params["sinks"] = (attn.sinks, lambda g: g)
    return Case(x, hf, kw, params, essential=("window", "sinks", "scale", "rope"))


def _qwen3():
    from transformers.models.qwen3 import modeling_qwen3 as m
    config = _config(transformers.Qwen3Config, attention_bias=True)

    def setup(attn):
        for norm in (attn.q_norm, attn.k_norm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)   # ones at init: make them count
    attn, rotary, x, hf, kw, params = _rope_model(m.Qwen3Attention, m.Qwen3RotaryEmbedding,
                                                  config, x_scale=0.05, setup=setup)
    kw.update(q_norm=_np(attn.q_norm.weight), k_norm=_np(attn.k_norm.weight),
              norm_eps=config.rms_norm_eps)
    params["q_norm"] = (attn.q_norm.weight, lambda g: g)
    params["k_norm"] = (attn.k_norm.weight, lambda g: g)
    return Case(x, hf, kw, params, essential=("q_norm", "k_norm", "rope"))


def _llama_left_padded():
    """A left-padded batch, as generate() prepares it: position_ids count real tokens."""
    from transformers.models.llama import modeling_llama as m
    config = _config(transformers.LlamaConfig)
    torch.manual_seed(0)
    attn = m.LlamaAttention(config, 0).double().eval()
    rotary = m.LlamaRotaryEmbedding(config).double()
    am = torch.ones(B, T, dtype=torch.long)
    am[0, :3] = 0
    pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
    x = _x()

    def hf(xt, shipped):
        mask = create_causal_mask(config=config, inputs_embeds=xt, attention_mask=am,
                                  cache=None, position_ids=pos)
        return attn(xt, position_embeddings=_tables(rotary, xt, pos, shipped),
                    attention_mask=mask)
    kw, params = _linear(attn)
    kw.update(causal=True, rope=mhattn.RoPE(inv_freq=_np(rotary.inv_freq)),
              key_mask=_np(am).astype(bool), positions=_np(pos), key_positions=_np(pos))
    # HF gives a padding query (it sees no real key) a uniform average over
    # the pads; mhattn gives it zero attention.  Only real queries are compared.
    # positions= must be passed but cannot be told apart here: RoPE depends on
    # p_i - j only, and left padding shifts a row's queries and keys alike.
    return Case(x, hf, kw, params, essential=("key_mask",), rows=_np(am).astype(bool))


def _llama_packed():
    """Three sequences packed in one row: HF finds them from position_ids."""
    from transformers.models.llama import modeling_llama as m
    config = _config(transformers.LlamaConfig)
    torch.manual_seed(0)
    attn = m.LlamaAttention(config, 0).double().eval()
    rotary = m.LlamaRotaryEmbedding(config).double()
    cu = np.array([0, 3, 7, 9])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]])
    x = _x(shape=(9, D))

    def hf(xt, shipped):
        xb = xt[None]
        mask = create_causal_mask(config=config, inputs_embeds=xb, attention_mask=None,
                                  cache=None, position_ids=pos)
        out, weights = attn(xb, position_embeddings=_tables(rotary, xb, pos, shipped),
                            attention_mask=mask)
        return out[0], weights[0]
    kw, params = _linear(attn)
    kw.update(causal=True, rope=mhattn.RoPE(inv_freq=_np(rotary.inv_freq)), cu_seqlens=cu)
    return Case(x, hf, kw, params, essential=("cu_seqlens",))


def _bloom(padded=False):
    from transformers.models.bloom import modeling_bloom as m
    config = transformers.BloomConfig(hidden_size=D, n_head=H, n_layer=1, vocab_size=16)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = m.BloomAttention(config, 0).double().eval()
    am = torch.ones(B, T, dtype=torch.long)
    if padded:
        am[1, :2] = 0
    x = _x(scale=2.0)
    slopes = _np(m.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), H,
                                      torch.float64)[:, 0, 1])      # slope * 1

    def hf(xt, shipped):
        alibi = m.build_alibi_tensor(am, H, xt.dtype)
        mask = create_causal_mask(config=config, inputs_embeds=xt, attention_mask=am,
                                  cache=None)
        return attn(xt, torch.zeros_like(xt), alibi, mask)
    # BLOOM's fused query_key_value: row block h*3*HD holds head h's q, then k, then v.
    wt = _np(attn.query_key_value.weight).T           # (D, 3D)
    bias = _np(attn.query_key_value.bias)
    cols = {n: (np.arange(H)[:, None] * 3 * HD + i * HD + np.arange(HD)).ravel()
            for i, n in enumerate("qkv")}
    kw = dict(num_heads=H, w_o=_np(attn.dense.weight).T, b_o=_np(attn.dense.bias),
              causal=True, alibi_slopes=slopes)
    params = {"w_o": (attn.dense.weight, lambda g: g.T), "b_o": (attn.dense.bias, lambda g: g)}
    for n, c in cols.items():
        kw[f"w_{n}"] = np.ascontiguousarray(wt[:, c])
        kw[f"b_{n}"] = bias[c]
        params[f"w_{n}"] = (attn.query_key_value.weight, lambda g, c=c: g.T[:, c])
        params[f"b_{n}"] = (attn.query_key_value.bias, lambda g, c=c: g[c])
    # HF adds slope * j (j counting real keys); mhattn -slope |p_i - j|.  Under
    # causal masking j <= p_i, so the two differ by slope * p_i, the same for
    # every key of a row: the softmax does not see it.
    essential = ("alibi_slopes",)
    rows = None
    if padded:
        kw["key_mask"] = _np(am).astype(bool)
        essential += ("key_mask",)
        rows = _np(am).astype(bool)
    return Case(x, hf, kw, params, essential=essential, rows=rows)


MODELS = {"llama": _llama, "mistral": _mistral, "gemma2": _gemma2, "gpt_oss": _gpt_oss,
          "qwen3": _qwen3, "bloom": _bloom, "bloom_left_padded": lambda: _bloom(True),
          "llama_left_padded": _llama_left_padded, "llama_packed": _llama_packed}


@pytest.fixture(params=sorted(MODELS))
def case(request):
    return MODELS[request.param]()


def _hf_run(case, shipped=False):
    """HF's (out, weights) as arrays."""
    with torch.no_grad(), (contextlib.nullcontext() if shipped else _float64_throughout()):
        return tuple(_np(a) for a in case.hf(torch.from_numpy(case.x), shipped))


def _hf_out(case, shipped=False) -> np.ndarray:
    return _hf_run(case, shipped)[0]


def _rows(case, a):
    return a if case.rows is None else a[case.rows]


def _check_forward(case, got, want, **tol):
    got, want = _rows(case, got), _rows(case, want)
    scale = np.abs(want).max()
    assert scale > 1e-3          # the module computes something
    np.testing.assert_allclose(got, want,
                               rtol=tol.get("rtol", FWD["rtol"]),
                               atol=tol.get("atol", FWD["atol"]) * max(1.0, scale))


def test_reference_matches_hf(case):
    _check_forward(case, R.multi_head_attention(case.x, **case.kw), _hf_out(case))


def test_core_matches_hf(case, isa):
    _check_forward(case, mhattn.multi_head_attention(case.x, **case.kw), _hf_out(case))


def test_weights_match_hf(case):
    """The post-softmax weights (gpt-oss's without the sink column), from
    the reference and the core."""
    want = _hf_run(case)[1]
    for fn in (R.multi_head_attention, mhattn.multi_head_attention):
        got = fn(case.x, return_weights=True, **case.kw)[1]
        assert got.shape == want.shape
        if case.rows is not None:          # (B, H, T, T) -> (real rows, H, T)
            got, want_rows = got.transpose(0, 2, 1, 3)[case.rows], \
                want.transpose(0, 2, 1, 3)[case.rows]
        else:
            want_rows = want
        np.testing.assert_allclose(got, want_rows, rtol=1e-9, atol=1e-13)


def test_every_variant_matters(case):
    """Dropping any one of the case's keywords moves the reference far from HF:
    the comparisons above can fail."""
    want = _hf_out(case)
    for name in case.essential:
        kw = {k: v for k, v in case.kw.items() if k != name}
        if name == "cu_seqlens":
            kw.pop("key_cu_seqlens", None)
        got = R.multi_head_attention(case.x, **kw)
        assert not np.allclose(_rows(case, got), _rows(case, want), rtol=1e-4, atol=1e-6), name


def test_shipped_hf_agrees(case):
    """HF exactly as shipped (float32 softmax, rotary tables and RMSNorm
    inside a float64 module) agrees to float32 accuracy."""
    _check_forward(case, R.multi_head_attention(case.x, **case.kw),
                   _hf_out(case, shipped=True), rtol=1e-5, atol=1e-6)


def _torch_grads(case, grad_out) -> dict:
    """Autograd's gradients of sum(out * grad_out), float64 throughout, in
    mhattn's names and forms."""
    xt = torch.from_numpy(case.x.copy()).requires_grad_(True)
    for p, _ in case.params.values():
        p.grad = None
    with _float64_throughout():
        out = case.hf(xt, False)[0]
        (out * torch.from_numpy(grad_out)).sum().backward()
    want = {"x": _np(xt.grad)}
    for name, (p, to_mhattn) in case.params.items():
        want[name] = to_mhattn(_np(p.grad))
    return want


def _grad_out(case) -> np.ndarray:
    grad_out = np.random.default_rng(7).standard_normal(_hf_out(case).shape)
    if case.rows is not None:
        grad_out[~case.rows] = 0       # rows HF leaves undefined carry no loss
    return grad_out


def test_torch_grads_are_the_reference_derivative(case):
    """The expected gradients, mapped to mhattn's forms, are the derivative
    of the reference: <dL/da, u> = central difference of L along u."""
    grad_out = _grad_out(case)
    want = _torch_grads(case, grad_out)
    named = {k: v for k, v in case.kw.items() if k in want}
    named["x"] = case.x
    rest = {k: v for k, v in case.kw.items() if k not in named}
    rng = np.random.default_rng(3)
    eps = 1e-6

    def loss(**changed):
        a = dict(named, **changed)
        return float(np.sum(R.multi_head_attention(a.pop("x"), **a, **rest) * grad_out))
    for name, value in named.items():
        u = rng.standard_normal(np.shape(value))
        fd = (loss(**{name: value + eps * u}) - loss(**{name: value - eps * u})) / (2 * eps)
        have = float(np.sum(want[name] * u))
        assert abs(have - fd) <= 1e-6 * max(1.0, abs(fd)), (name, have, fd)


def test_core_grad_matches_torch_autograd(case):
    grad_out = _grad_out(case)
    want = _torch_grads(case, grad_out)
    got = mhattn.multi_head_attention_grad(grad_out, case.x, **case.kw)
    assert set(want) <= set(got), f"mhattn returned no gradient for {set(want) - set(got)}"
    for name, w in want.items():
        g = np.asarray(got[name])
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=GRAD_RTOL,
                                   atol=1e-11 * max(1.0, np.abs(w).max()), err_msg=name)


def _llama_decode(xt, cut):
    """HF's two-step run: the prefix fills a DynamicCache, then the last
    tokens attend to the whole cache.  Returns (module, rotary, out of the
    second step)."""
    from transformers.models.llama import modeling_llama as m
    config = _config(transformers.LlamaConfig, attention_bias=True)
    torch.manual_seed(0)
    attn = m.LlamaAttention(config, 0).double().eval()
    rotary = m.LlamaRotaryEmbedding(config).double()
    cache = transformers.DynamicCache(config=config)
    out = None
    for lo, hi in ((0, cut), (cut, T)):
        pos = torch.arange(lo, hi)[None].expand(B, hi - lo)
        part = xt[:, lo:hi]
        mask = create_causal_mask(config=config, inputs_embeds=part, attention_mask=None,
                                  cache=cache, position_ids=pos)
        out = attn(part, position_embeddings=_tables(rotary, part, pos, False),
                   attention_mask=mask, cache=cache)[0]
    return attn, rotary, out


@pytest.mark.parametrize("cut", [4, 6])
def test_decode_against_a_cache_matches_hf(isa, cut):
    """New tokens against HF's KV cache: mhattn's bottom-right causal
    alignment and default RoPE positions p_i = i + (T_k - T_q) are the cache's."""
    x = _x()
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    with _float64_throughout():
        attn, rotary, out = _llama_decode(xt, cut)
    want = _np(out)
    kw, params = _linear(attn)
    kw.update(key=x, causal=True, rope=mhattn.RoPE(inv_freq=_np(rotary.inv_freq)))
    case = Case(x[:, cut:], None, kw, params, essential=())
    _check_forward(case, R.multi_head_attention(x[:, cut:], **kw), want)
    _check_forward(case, mhattn.multi_head_attention(x[:, cut:], **kw), want)
    grad_out = np.random.default_rng(5).standard_normal(want.shape)
    with _float64_throughout():
        (out * torch.from_numpy(grad_out)).sum().backward()
    got = mhattn.multi_head_attention_grad(grad_out, x[:, cut:], **kw)
    dx = np.array(got["key"])                  # x fed every key and value ...
    dx[:, cut:] += got["x"]                    # ... and the new tokens' queries
    np.testing.assert_allclose(dx, _np(xt.grad), rtol=GRAD_RTOL,
                               atol=1e-11 * np.abs(dx).max())
    for name, (p, to_mhattn) in params.items():
        w = to_mhattn(_np(p.grad))
        np.testing.assert_allclose(got[name], w, rtol=GRAD_RTOL,
                                   atol=1e-11 * max(1.0, np.abs(w).max()), err_msg=name)
