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
    with pytest.raises(MemoryError, match=r"^rotary_dim needs "):
        rope.frequencies(rd)
    x = np.ones((2, 4))
    with pytest.raises(MemoryError, match=r"^rotary_dim needs "):
        mhattn.multi_head_attention(x, np.eye(4), np.eye(4), np.eye(4), num_heads=1,
                                    rope=rope)
