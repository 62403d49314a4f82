"""A transformers Llama attention layer in bfloat16 against mhattn in bfloat16
(issue 36).

One LlamaAttention of a tiny random LlamaConfig (hidden 64, 4 heads over 2
kv heads of 16, RoPE, q/k/v/o biases) is cast to torch.bfloat16, so that its
weights are bfloat16 values; the inputs are bfloat16 too.  The same values go
to mhattn as ml_dtypes.bfloat16 arrays (tests/test_hf_oracle.py maps the
weights: nn.Linear's (out, in) transposed; ``mhattn.RoPE(inv_freq=...)``).

The truth is the float64 result of the same layer on those same bf16
weights and inputs: HF's module in float64 with its float32 round trips
off (test_hf_oracle's ``_float64_throughout`` and float64 rotary tables),
which mhattn.reference must equal to float64 accuracy.  Against it:

- mhattn's bf16 output is within the documented bound (``half_bound``:
  half a bf16 ulp plus 2^-16 of the largest magnitude);
- mhattn's largest error is at most HF's own bf16 layer's, run as shipped
  (bf16 projections, rotary tables rounded to bf16, float32 softmax
  rounded back to bf16), with eager attention and with SDPA;

on each ISA path this machine has.
"""
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")

import mhattn  # noqa: E402
from mhattn import reference as R  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402

from test_half_dtypes import BF16, assert_within  # noqa: E402
from test_hf_oracle import _config, _float64_throughout, _linear, _tables  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16


def _as_bf16_array(t):
    """A bf16 (or any) tensor as an ml_dtypes.bfloat16 array of the same values."""
    return t.detach().to(torch.float64).numpy().astype(BF16)


def _llama(impl, seed):
    from transformers.models.llama import modeling_llama as m
    config = _config(transformers.LlamaConfig, hidden_size=HIDDEN, num_attention_heads=HEADS,
                     num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, attention_bias=True)
    config._attn_implementation = impl
    torch.manual_seed(seed)
    attn = m.LlamaAttention(config, 0).to(torch.bfloat16).eval()
    with torch.no_grad():          # biases matter (nn.Linear's init keeps them small)
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            lin.bias.copy_(0.2 * torch.randn(lin.bias.shape))
    rotary = m.LlamaRotaryEmbedding(config)
    return config, attn, rotary


def _run(config, attn, rotary, xt, shipped):
    B, T, _ = xt.shape
    pos = torch.arange(T)[None].expand(B, T)
    mask = create_causal_mask(config=config, inputs_embeds=xt, attention_mask=None, cache=None,
                              position_ids=pos)
    with torch.no_grad():
        return attn(xt, position_embeddings=_tables(rotary, xt, pos, shipped),
                    attention_mask=mask)[0]


@pytest.mark.parametrize("T", [9, 64])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_llama_bf16_within_bound_and_no_worse_than_hf(isa, impl, seed, T):
    config, attn, rotary = _llama(impl, seed)
    x = np.random.default_rng(seed).standard_normal((2, T, HIDDEN)).astype(BF16)
    x_bf16 = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)

    # HF in bf16, as shipped
    theirs = _run(config, attn, rotary, x_bf16, shipped=True)
    assert theirs.dtype == torch.bfloat16
    theirs = theirs.to(torch.float64).numpy()

    # the float64 truth: the same module, its bf16 weights widened exactly
    attn64 = attn.to(torch.float64)        # the bf16 run is done: the module may change
    config._attn_implementation = "eager"
    with _float64_throughout():
        want = _run(config, attn64, rotary.to(torch.float64), x_bf16.to(torch.float64),
                    shipped=False).numpy()

    # mhattn: the same bf16 values (the module's weights are now their float64 widening)
    kw, _ = _linear(attn64)
    kw = {k: (v.astype(BF16) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    assert (kw["num_heads"], kw["num_kv_heads"]) == (HEADS, KV_HEADS)
    kw.update(causal=True, rope=mhattn.RoPE(inv_freq=rotary.inv_freq.to(torch.float64).numpy()))
    ref = R.multi_head_attention(x, **kw)
    np.testing.assert_allclose(ref, want, rtol=1e-9, atol=1e-12 * np.abs(want).max())
    ours = mhattn.multi_head_attention(x, **kw)
    assert ours.dtype == BF16

    assert_within(ours, want, BF16, f"llama {impl} seed {seed} T {T}")
    e_ours = float(np.abs(ours.astype(np.float64) - want).max())
    e_hf = float(np.abs(theirs - want).max())
    assert e_ours <= e_hf, f"mhattn's error {e_ours:.4g} > HF bf16's {e_hf:.4g}"
    # HF's bf16 layer really rounds in bfloat16: the comparison is not of two zeros
    assert e_hf > np.abs(want).max() * 2.0 ** -9
