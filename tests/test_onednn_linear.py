"""Linear layers through oneDNN (`smc_sd.backends.onednn_linear`): the same logits as `F.linear`
within the float32 tolerance of this processor, gradients and other dtypes untouched, and the
default model loaded with them."""

import torch

from smc_sd import testing
from smc_sd.backends.onednn_linear import onednn_forward, onednn_linear_available, use_onednn_linears
from tests.tiny_llama import tiny_llama

ROWS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 7, 2]]


def linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_routed_logits_equal_blas_logits_within_the_float32_tolerance():
    assert onednn_linear_available()
    model = tiny_llama(vocab=64, layers=3)
    atol = testing.float32_logit_tolerance(model, ROWS)
    ids = torch.tensor([ROWS[0]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert use_onednn_linears(model) == len(linears(model)) > 0
        after = model(input_ids=ids).logits
    assert all(m.forward.__func__ is onednn_forward for m in linears(model))
    assert (before - after).abs().max().item() <= atol


def test_gradients_and_bfloat16_take_f_linear():
    model = tiny_llama(vocab=64).requires_grad_(True)
    use_onednn_linears(model)
    ids = torch.tensor([ROWS[1]])
    # autograd records the graph through F.linear: every weight receives a gradient
    model(input_ids=ids).logits.sum().backward()
    assert all(m.weight.grad is not None and bool(m.weight.grad.abs().sum() > 0) for m in linears(model))
    layer = linears(model)[0]
    x = torch.randn(2, layer.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, layer.weight.to(torch.bfloat16))
        layer.to(torch.bfloat16)
        assert torch.equal(layer(x), expected)


def test_the_default_model_loads_with_its_linears_routed(default_lm):
    assert all(m.forward.__func__ is onednn_forward for m in linears(default_lm.model))
