"""The linear kernels give a row the same bits whatever rows share the call."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import kernels, native

PATHS = {"portable": kernels.linear_portable, "native": kernels.linear_native}


def test_native_kernel_builds_on_this_machine():
    # The development and CI machines have AVX2 and a compiler: the fast path must be there.
    assert native.cpu_has_avx2_fma()
    assert native.load() is not None


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("shape", [(40, 24), (136, 96), (4864, 896)], ids=str)
def test_rows_bitwise_invariant(path, shape):
    linear = PATHS[path]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen)
    x = torch.randn(34, shape[1], generator=gen)
    alone = torch.cat([linear(x[i : i + 1], w) for i in range(34)])
    for n in (2, 3, 5, 9, 17, 33):
        for start in (0, 1):
            got = linear(x[start : start + n], w)
            assert torch.equal(got, alone[start : start + n]), (path, n, start)
    torch.testing.assert_close(alone, x @ w.T, atol=1e-4, rtol=1e-4)


def test_native_rejects_bad_input():
    with pytest.raises(RuntimeError):
        kernels.linear_native(torch.ones(2, 3), torch.ones(4, 5))
    with pytest.raises(RuntimeError):
        kernels.linear_native(torch.ones(2, 3, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64))
