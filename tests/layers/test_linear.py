"""The linear layers on one rank on CPU: the oneDNN layout (several rows) and the transposed weight
(one row) give F.linear's result on the plain weight. (On several ranks: tests/distributed.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from micro_vllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    onednn_runs,
    process_weights_after_loading,
)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_layouts_match_plain_linear(rows: int, bias: bool) -> None:
    model = torch.nn.Sequential(ColumnParallelLinear(48, 80, bias=bias), RowParallelLinear(80, 40, bias=bias),
                                MergedColumnParallelLinear(40, [16, 8], bias=bias))
    plain = [(layer.weight.clone(), None if layer.bias is None else layer.bias.clone()) for layer in model]
    x = torch.randn(rows, 48)
    process_weights_after_loading(model)
    assert all(layer.weight.is_mkldnn for layer in model)
    expected = x
    for weight, b in plain:
        expected = F.linear(expected, weight, b)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_only_fp32_cpu_weights_take_onednn() -> None:
    assert onednn_runs(torch.zeros(2, 2)) == torch.backends.mkldnn.is_available()
    assert not onednn_runs(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert not onednn_runs(torch.zeros(2, 2, device="meta"))
