"""How a cache slot stores a key or value (``rnnify.kernels.slots``): the error of each storage dtype
against the fp32 vector, and the int8 rounding's idempotence, on which a step computing what a
prefill does rests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rnnify.kernels.slots import KV_DTYPES, decode, encode, kv_dtype, levels_and_scales, slot_width

# vectors of any magnitude a key or value takes: zeros, fp32's smallest normals, large ones
MAGNITUDES = st.sampled_from([0.0, 1e-38, 1e-6, 0.01, 1.0, 37.0, 6e4])


@settings(max_examples=60, deadline=None)
@given(
    magnitude=MAGNITUDES,
    width=st.integers(1, 80),
    seed=st.integers(0, 2**31 - 1),
    name=st.sampled_from(list(KV_DTYPES)),
)
def test_a_slot_reads_back_the_vector_to_its_dtypes_precision(magnitude, width, seed, name):
    dtype = KV_DTYPES[name]
    gen = torch.Generator().manual_seed(seed)
    x = magnitude * torch.randn(3, 5, width, generator=gen)
    x[0, 0] = 0.0  # a vector of zeros
    slots = encode(x, dtype)
    assert slots.dtype == dtype and slots.shape == (3, 5, slot_width(width, dtype))
    back = decode(slots)
    assert back.dtype == torch.float32 and back.shape == x.shape
    largest = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:  # half a step of 2^e <= largest / 64, or a whole one where 128 rounds to 127
        bound = largest / 127 + 2.0**-128
    else:  # half an ulp, or a subnormal's spacing; float16 saturates past its largest value
        info = torch.finfo(dtype)
        bound = x.abs() * info.eps / 2 + info.tiny
        bound = torch.where(x.abs() > info.max, x.abs() - info.max, bound)
    assert ((back - x).abs() <= bound).all()


@settings(max_examples=60, deadline=None)
@given(magnitude=MAGNITUDES, seed=st.integers(0, 2**31 - 1), name=st.sampled_from(list(KV_DTYPES)))
def test_a_vector_read_back_and_written_again_reads_back_the_same(magnitude, seed, name):
    """What lets a prompt and a step read the same numbers whichever route a token takes; the bytes
    are the same too, except for a vector so small that its levels all round to 0."""
    dtype = KV_DTYPES[name]
    x = magnitude * torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))
    slots = encode(x, dtype)
    again = encode(decode(slots), dtype)
    assert torch.equal(decode(again), decode(slots))
    if magnitude > 1e-30:
        assert torch.equal(again, slots)


def test_levels_and_scales_multiply_to_the_read_back():
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-20, 20, 7)[:, None]
    levels, scales = levels_and_scales(encode(x, torch.int8))
    assert torch.equal(levels * scales, decode(encode(x, torch.int8)))
    assert levels_and_scales(encode(x, torch.bfloat16))[1] is None


def test_an_int8_vector_that_is_not_finite_reads_back_as_nan():
    """As a float slot carries an overflow on, so that it shows in the logits, not rounded away."""
    x = torch.tensor([[float("inf"), 1.0, 300.0], [float("nan"), 1.0, 2.0], [4.0, 1.0, -2.0]])
    back = decode(encode(x, torch.int8))
    assert back[:2].isnan().all() and torch.equal(back[2], x[2])
    assert torch.equal(encode(back, torch.int8), encode(x, torch.int8))


def test_int8_slots_take_a_quarter_of_fp32_and_one_byte_for_the_scale():
    assert slot_width(64, torch.int8) == 65
    assert slot_width(64, torch.float16) == slot_width(64, torch.float32) == 64
    x = torch.tensor([[1.0, -0.5, 0.25, 127.9]])
    levels, exponent = encode(x, torch.int8)[0, :-1], encode(x, torch.int8)[0, -1]
    assert int(exponent) == 0 and levels.tolist() == [1, 0, 0, 127]  # 127.9 at scale 1: [64, 128), 128 -> 127


def test_an_unknown_storage_dtype_is_refused_by_name():
    assert kv_dtype(None) is None and kv_dtype("int8") is torch.int8
    for name in ("int4", "float64", ["int8"], 8):
        with pytest.raises(ValueError, match="kv_dtype must be one of float16, bfloat16, int8, got "):
            kv_dtype(name)
