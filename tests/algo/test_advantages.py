import pytest
import torch

from megamu.algo import group_advantages


def test_eq1_hand_values():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773503 -> A = ±0.5 / 0.5773503 = ±0.8660254
    a = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(a, torch.tensor([[0.8660254, -0.8660254, -0.8660254, 0.8660254]]), atol=1e-5)
    # group [3, 1, 2]: mean 2, std 1 -> A = R - 2 (up to eps = 1e-6)
    a = group_advantages(torch.tensor([[3.0, 1.0, 2.0]]))
    assert torch.allclose(a, torch.tensor([[1.0, -1.0, 0.0]]), atol=1e-5)


def test_degenerate_groups_get_zero():
    a = group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert torch.equal(a[:2], torch.zeros(2, 3))
    assert a[2, 1] > 0 and a[2, 0] < 0
    assert torch.equal(group_advantages(torch.tensor([[0.7], [0.2]])), torch.zeros(2, 1))


def test_mean_centred_option():
    a = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), normalize_std=False)
    assert torch.allclose(a, torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_shape_error_is_clear():
    with pytest.raises(ValueError, match="n_groups, G"):
        group_advantages(torch.zeros(8))
