"""The reference engine's CPU kernels (engines/reference/cpu_kernels.c), the bf16 linear and
RMSNorm: each compiled kernel gives the bits its PyTorch specification gives, and a row's output
does not depend on how many rows are computed with it (decode, verify and a batch agree bit for
bit)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.engines.reference import cpu_kernels
from speccheck.engines.reference.cpu_kernels import (rms_norm, rms_norm_torch, rowinv_linear,
                                                    rowinv_linear_torch)

pytestmark = pytest.mark.skipif(cpu_kernels._kernel() is None, reason="no C compiler here")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 30), n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 2**16),
       fp32=st.booleans())
def test_kernel_equals_its_specification_and_each_row_alone(m, n, k, seed, fp32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    dtype = torch.float32 if fp32 else torch.bfloat16
    got = rowinv_linear(x, w, dtype)
    assert torch.equal(bits(got), bits(rowinv_linear_torch(x, w, dtype)))
    for i in range(m):
        assert torch.equal(bits(rowinv_linear(x[i:i + 1], w, dtype)[0]), bits(got[i]))
    exact = x.double() @ w.double().T
    assert torch.allclose(got.double(), exact, rtol=1e-2 if not fp32 else 1e-5, atol=1e-5)


def test_a_prefill_sized_product_takes_the_wide_path_with_the_same_bits():
    """Past 96 rows (two row blocks of the wide path) and a K that is no multiple of 16."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 72, generator=g).bfloat16()
    w = (torch.randn(40, 72, generator=g) * 0.1).bfloat16()
    got = rowinv_linear(x, w)
    assert torch.equal(bits(got), bits(rowinv_linear_torch(x, w)))
    assert torch.equal(bits(rowinv_linear(x[150:151], w)[0]), bits(got[150]))


def test_leading_dims_and_non_contiguous_inputs():
    x = torch.randn(2, 3, 40).bfloat16()
    w = torch.randn(24, 40).bfloat16()
    got = rowinv_linear(x.transpose(0, 1), w)
    assert got.shape == (3, 2, 24)
    assert torch.equal(bits(got), bits(rowinv_linear_torch(x.transpose(0, 1).contiguous(), w)))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 12), d=st.integers(1, 300), seed=st.integers(0, 2**16),
       x_bf16=st.booleans(), fp32=st.booleans(), scaled=st.booleans())
def test_rms_norm_equals_its_specification_and_each_row_alone(m, d, seed, x_bf16, fp32, scaled):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g) * 3
    x = x.bfloat16() if x_bf16 else x
    scale = 1 + 0.1 * torch.randn(d, generator=g) if scaled else None
    dtype = torch.float32 if fp32 else torch.bfloat16
    got = rms_norm(x, scale, 1e-6, dtype)
    assert torch.equal(bits(got), bits(rms_norm_torch(x, scale, 1e-6, dtype)))
    for i in range(m):
        assert torch.equal(bits(rms_norm(x[i:i + 1], scale, 1e-6, dtype)[0]), bits(got[i]))
    want = torch.nn.functional.rms_norm(x.double(), (d,), None if scale is None else scale.double(),
                                        1e-6)
    assert torch.allclose(got.double(), want, rtol=1e-2 if not fp32 else 1e-5, atol=1e-5)
