"""Hostile callers, round 2 (issue 35): the layer, the PyTorch mask
converters and RoPE name every bad argument (TypeError / ValueError whose
message starts with the argument's name, or MemoryError naming it) before
allocating, never a bare NumPy or Python error."""
import numpy as np
import pytest

import mhattn

HUGE = 2 ** 40


# -- RoPE ---------------------------------------------------------------------

def test_rope_inv_freq_string_named():
    with pytest.raises(TypeError, match=r"^inv_freq: "):
        mhattn.RoPE(inv_freq="a")


def test_rope_inv_freq_complex_refused():
    with pytest.raises(TypeError, match=r"^inv_freq: "):
        mhattn.RoPE(inv_freq=np.array([1.0 + 2.0j, 0.5]))


def test_rope_frequencies_rotary_dim_type_named():
    with pytest.raises(TypeError, match=r"^rotary_dim: "):
        mhattn.RoPE().frequencies("a")


@pytest.mark.parametrize("rd", [0, -2])
def test_rope_frequencies_rotary_dim_non_positive(rd):
    with pytest.raises(ValueError, match=r"^rotary_dim: "):
        mhattn.RoPE().frequencies(rd)


@pytest.mark.parametrize("rd", [HUGE, 2 ** 63])
def test_rope_huge_rotary_dim_set_after_construction(rd):
    rope = mhattn.RoPE()
    rope.rotary_dim = rd
    with pytest.raises(ValueError, match=r"^rotary_dim: "):
        rope.frequencies(rd)
    x = np.ones((2, 4))
    with pytest.raises(ValueError, match=r"^rotary_dim: "):
        mhattn.multi_head_attention(x, np.eye(4), np.eye(4), np.eye(4), num_heads=1,
                                    rope=rope)


# -- the PyTorch mask converters ------------------------------------------------

def test_to_torch_attn_mask_as_tensor_not_bool():
    with pytest.raises(TypeError, match=r"^as_tensor: "):
        mhattn.to_torch_attn_mask(np.ones((2, 2), bool), as_tensor="yes")


def test_to_torch_attn_mask_huge_broadcast_named():
    big = np.broadcast_to(True, (2 ** 20, 2 ** 20))
    with pytest.raises(MemoryError, match=r"^mask needs "):
        mhattn.to_torch_attn_mask(big)
    with pytest.raises(MemoryError, match=r"^mask needs "):
        mhattn.to_torch_attn_mask(np.ones((1, 1), bool), tgt_len=2 ** 20, src_len=2 ** 20)


@pytest.mark.parametrize("fill", [True, np.float32(0)])
def test_from_torch_masks_huge_attn_mask_named(fill):
    with pytest.raises(MemoryError, match=r"^attn_mask needs "):
        mhattn.from_torch_masks(np.broadcast_to(fill, (2 ** 20, 2 ** 20)))


def test_from_torch_masks_huge_key_padding_mask_named():
    with pytest.raises(MemoryError, match=r"^key_padding_mask needs "):
        mhattn.from_torch_masks(key_padding_mask=np.broadcast_to(False, (2 ** 20, 2 ** 20)))
    with pytest.raises(MemoryError, match=r"attn_mask with key_padding_mask"):
        mhattn.from_torch_masks(np.ones((2 ** 15, 1), bool),
                                key_padding_mask=np.broadcast_to(False, (2 ** 15, 2 ** 15)))


# -- MultiHeadAttention ---------------------------------------------------------

@pytest.mark.parametrize("seed, exc", [("abc", TypeError), (-1, ValueError),
                                       (1.5, TypeError)])
def test_layer_seed_named(seed, exc):
    with pytest.raises(exc, match=r"^seed: "):
        mhattn.MultiHeadAttention(8, 2, seed=seed)
    layer = mhattn.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(exc, match=r"^seed: "):
        layer.reset_parameters(seed)


def test_layer_norm_eps_string_named():
    with pytest.raises(TypeError, match=r"^norm_eps: "):
        mhattn.MultiHeadAttention(8, 2, qk_norm=True, norm_eps="a")


@pytest.mark.parametrize("kw, words", [
    (dict(d_model=HUGE, num_heads=1), "d_model"),
    (dict(d_model=8, num_heads=2, d_k=HUGE), "d_k"),
    (dict(d_model=2 ** 70, num_heads=1), "d_model"),
])
def test_layer_huge_dimensions_named_memory_error(kw, words):
    with pytest.raises(MemoryError, match=r"^w_. needs .*" + words):
        mhattn.MultiHeadAttention(**kw)


@pytest.mark.parametrize("state", [None, 5])
def test_layer_load_state_dict_not_a_mapping(state):
    layer = mhattn.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(TypeError, match=r"^state_dict: expected a mapping"):
        layer.load_state_dict(state)


def test_layer_assigned_weight_error_knows_num_heads():
    layer = mhattn.MultiHeadAttention(8, 2, seed=0)
    layer.w_q = np.ones((8, 3))
    with pytest.raises(ValueError, match=r"^w_q: ") as info:
        layer(np.ones((3, 8), np.float32))
    assert "need num_heads" not in str(info.value)
    assert "num_heads=2" in str(info.value)
