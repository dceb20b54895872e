"""Linear layers through oneDNN (`smc_sd.backends.onednn_linear`): the same logits as `F.linear`
within the float32 tolerance of this processor; a packed weight never stale; gradients untouched;
bfloat16 within one rounding of `F.linear`; and every model the hf backend wraps on the CPU routed."""

import copy

import pytest
import torch

from smc_sd import testing
from smc_sd.backends import onednn_linear
from smc_sd.backends.onednn_linear import onednn_dtypes, onednn_forward, onednn_linear_available, use_onednn_linears
from tests.tiny_llama import lm, tiny_llama

ROWS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 7, 2]]


def linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("pack", [True, False])
def test_routed_logits_equal_blas_logits_within_the_float32_tolerance(pack):
    assert onednn_linear_available()
    model = tiny_llama(vocab=64, layers=3)
    atol = testing.float32_logit_tolerance(model, ROWS)
    ids = torch.tensor([ROWS[0]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert use_onednn_linears(model, pack=pack) == len(linears(model)) > 0
        after = model(input_ids=ids).logits
    assert all(m.forward.__func__ is onednn_forward for m in linears(model))
    assert all((m._onednn_packed.tensor is not None) == pack for m in linears(model))
    assert (before - after).abs().max().item() <= atol


def test_weights_are_packed_only_within_the_memory_share(monkeypatch):
    model = tiny_llama(vocab=64)
    weight_bytes = sum({m.weight.data_ptr(): m.weight.nbytes for m in linears(model)}.values())
    share = onednn_linear.PACKING_MEMORY_SHARE
    monkeypatch.setattr(onednn_linear, "available_memory_bytes", lambda: int(weight_bytes / share))
    use_onednn_linears(model)
    assert all(m._onednn_pack for m in linears(model))
    monkeypatch.setattr(onednn_linear, "available_memory_bytes", lambda: int(weight_bytes / share) - 64)
    use_onednn_linears(model)
    assert not any(m._onednn_pack for m in linears(model))


def test_a_weight_changed_after_packing_is_packed_again():
    layer = torch.nn.Linear(16, 8).requires_grad_(False)
    use_onednn_linears(layer, pack=True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(-2.0)  # in place: same storage, new version
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)  # replaced
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_a_copied_model_packs_its_own_weights():
    model = tiny_llama(vocab=64)
    use_onednn_linears(model, pack=True)
    ids = torch.tensor([ROWS[0]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        twin = copy.deepcopy(model)
        assert torch.allclose(twin(input_ids=ids).logits, expected, atol=1e-6)
    assert all(t._onednn_packed.tensor is not m._onednn_packed.tensor for t, m in zip(linears(twin), linears(model)))


def test_gradients_take_f_linear():
    model = tiny_llama(vocab=64).requires_grad_(True)
    use_onednn_linears(model)
    # autograd records the graph through F.linear: every weight receives a gradient
    model(input_ids=torch.tensor([ROWS[1]])).logits.sum().backward()
    assert all(m.weight.grad is not None and bool(m.weight.grad.abs().sum() > 0) for m in linears(model))


def test_bfloat16_is_within_one_rounding_of_f_linear():
    layer = linears(tiny_llama(vocab=64))[0]
    use_onednn_linears(layer, pack=True)
    layer.to(torch.bfloat16)
    x = torch.randn(5, layer.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, layer.weight).float()
        got = layer(x).float()
        # both sum in float32 (orders differ by at most in_features float32 roundings of the
        # terms' magnitudes), then round once to bfloat16 (2^-8 relative each)
        magnitude = x.float().abs() @ layer.weight.float().abs().T
    bound = 2.0**-8 * (expected.abs() + got.abs()) + layer.in_features * 2.0**-24 * magnitude
    assert bool((got - expected).abs().le(bound).all())
    assert (layer._onednn_packed.tensor is not None) == (torch.bfloat16 in onednn_dtypes())


def test_every_cpu_model_the_hf_backend_wraps_is_routed(default_lm):
    assert all(m.forward.__func__ is onednn_forward for m in linears(default_lm.model))
    built = lm(tiny_llama(vocab=64))
    assert all(m.forward.__func__ is onednn_forward for m in linears(built.model))
