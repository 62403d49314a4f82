"""mhattn's cached step against Hugging Face's generate() with past_key_values.

A tiny random one-layer GPT-2 and Llama (float64, eager attention) generate
greedily with their own KV cache.  The same models are then recomputed in
NumPy, with mhattn's cached step, ``multi_head_attention(x_new, ...,
causal=True, cache=cache)``, as their attention layer: a prefill of the
prompt, then one token at a time.  The tokens must be the same and the
logits of every step equal to rounding (HF rounds Llama's RMSNorm and rotary
angles through float32, hence 1e-5), and mhattn's cache must hold HF's keys
and values.
"""
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import mhattn                                           # noqa: E402

B, PROMPT, NEW = 2, 5, 6
LOGITS = dict(rtol=1e-5, atol=1e-6)


def _np(t) -> np.ndarray:
    return np.ascontiguousarray(t.detach().numpy())


def _hf_generate(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor(ids), max_new_tokens=NEW, do_sample=False,
                             use_cache=True, return_dict_in_generate=True,
                             output_logits=True, pad_token_id=0)
    return _np(out.sequences), np.stack([_np(s) for s in out.logits], 1), out.past_key_values


def _greedy(step, ids, cache):
    """Greedy decoding with step(tokens (B, T), positions (B, T)) -> logits."""
    tokens, logits = ids.copy(), []
    new = ids
    for _ in range(NEW):
        pos = cache.lengths[:, None] + np.arange(new.shape[1])
        last = step(new, pos)[:, -1]
        logits.append(last)
        new = last.argmax(-1)[:, None]
        tokens = np.concatenate([tokens, new], axis=1)
    return tokens, np.stack(logits, 1)


def _hf_layer_kv(past):
    """(keys, values) of layer 0 of HF's cache, (B, G, T, d)."""
    if hasattr(past, "layers"):
        return _np(past.layers[0].keys), _np(past.layers[0].values)
    return _np(past[0][0]), _np(past[0][1])


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


@pytest.mark.slow
def test_gpt2_generate_matches_the_cached_step():
    config = transformers.GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1,
                                     n_head=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    sd = {k: _np(v) for k, v in model.state_dict().items()}
    E, nh = config.n_embd, config.n_head
    p = "transformer.h.0."
    w_attn, b_attn = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]
    w_q, w_k, w_v = np.split(w_attn, 3, axis=1)        # Conv1D: x @ W + b, row vectors
    b_q, b_k, b_v = np.split(b_attn, 3)
    eps = config.layer_norm_epsilon
    cache = mhattn.KVCache(B, nh, 32, E // nh, dtype=np.float64)

    def step(tokens, pos):
        h = sd["transformer.wte.weight"][tokens] + sd["transformer.wpe.weight"][pos]
        a = _layer_norm(h, sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps)
        h = h + mhattn.multi_head_attention(
            a, w_q, w_k, w_v, sd[p + "attn.c_proj.weight"], num_heads=nh, b_q=b_q,
            b_k=b_k, b_v=b_v, b_o=sd[p + "attn.c_proj.bias"], causal=True, cache=cache)
        m = _layer_norm(h, sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps)
        m = m @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"]
        m = 0.5 * m * (1 + np.tanh(np.sqrt(2 / np.pi) * (m + 0.044715 * m ** 3)))
        h = h + m @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
        h = _layer_norm(h, sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"], eps)
        return h @ sd["transformer.wte.weight"].T

    _check_against_hf(model, step, cache, seed=0, kv_tol=dict(rtol=1e-9, atol=1e-12))


def _check_against_hf(model, step, cache, seed, kv_tol):
    """Greedy decoding through `step` and the cache picks HF generate()'s
    tokens with its logits, and the cache ends up holding HF's keys and
    values (past_key_values) of the one layer."""
    ids = np.random.default_rng(seed).integers(1, model.config.vocab_size, (B, PROMPT))
    hf_tokens, hf_logits, past = _hf_generate(model, ids)
    tokens, logits = _greedy(step, ids, cache)
    np.testing.assert_array_equal(tokens, hf_tokens)
    np.testing.assert_allclose(logits, hf_logits, **LOGITS)
    k, v = _hf_layer_kv(past)
    n = k.shape[2]
    np.testing.assert_allclose(cache.keys[:, :, :n], k, **kv_tol)
    np.testing.assert_allclose(cache.values[:, :, :n], v, **kv_tol)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_llama_generate_matches_the_cached_step():
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      attn_implementation="eager")
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).double().eval()
    sd = {k: _np(v) for k, v in model.state_dict().items() if "inv_freq" not in k}
    inv_freq = _np(model.model.rotary_emb.inv_freq).astype(np.float64)
    H, G, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    p = "model.layers.0."
    eps = config.rms_norm_eps
    rope = mhattn.RoPE(inv_freq=inv_freq)
    cache = mhattn.KVCache(B, G, 32, hd, dtype=np.float64)
    w = {n: sd[p + f"self_attn.{n}_proj.weight"].T for n in "qkvo"}

    def step(tokens, pos):
        h = sd["model.embed_tokens.weight"][tokens]
        a = _rms(h, sd[p + "input_layernorm.weight"], eps)
        h = h + mhattn.multi_head_attention(a, w["q"], w["k"], w["v"], w["o"], num_heads=H,
                                            num_kv_heads=G, rope=rope, causal=True,
                                            cache=cache)
        m = _rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        gate = m @ sd[p + "mlp.gate_proj.weight"].T
        up = m @ sd[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ sd[p + "mlp.down_proj.weight"].T
        return _rms(h, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T

    # HF caches the keys after RoPE, as mhattn does (HF's float32 RMSNorm
    # and rotary angles: float32 rounding).
    _check_against_hf(model, step, cache, seed=1, kv_tol=dict(rtol=1e-5, atol=1e-6))
