import numpy as np
import pytest
import torch

from sage_grpo.advantage import group_advantages


def _reference(rewards, groups, eps=1e-8, clip=5.0):
    """Per-group numpy computation with failed rewards excluded."""
    r, gid = np.asarray(rewards, dtype=np.float64), np.asarray(groups)
    out = np.zeros_like(r)
    for g in np.unique(gid):
        idx = np.where((gid == g) & np.isfinite(r))[0]
        if len(idx) < 2 or np.ptp(r[idx]) == 0:
            continue
        out[idx] = (r[idx] - r[idx].mean()) / (r[idx].std() + eps)
    return np.clip(out, -clip, clip)


def test_matches_numpy_reference_and_population_std():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=g)
    groups = torch.arange(3).repeat_interleave(4)
    adv, valid = group_advantages(rewards, groups)
    np.testing.assert_allclose(adv.numpy(), _reference(rewards.numpy(), groups.numpy()), rtol=1e-5, atol=1e-6)
    assert valid.all()
    # population std: each group's advantages have unit (biased) variance
    for k in range(3):
        assert adv[groups == k].double().pow(2).mean().item() == pytest.approx(1.0, rel=1e-5)


def test_failed_rewards_are_masked_not_zeroed():
    rewards = torch.tensor([1.0, 2.0, float("nan"), 4.0, 0.5, float("inf"), 0.5, 0.7])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, valid = group_advantages(rewards, groups)
    assert valid.tolist() == [True, True, False, True, True, False, True, True]
    assert adv[2] == 0 and adv[5] == 0 and torch.isfinite(adv).all()
    np.testing.assert_allclose(adv.numpy(), _reference(rewards.numpy(), groups.numpy()), rtol=1e-5, atol=1e-6)
    zero_filled, _ = group_advantages(torch.nan_to_num(rewards, nan=0.0, posinf=0.0), groups)
    assert not torch.allclose(adv[:2], zero_filled[:2])  # replacing by 0 would have biased the others


def test_constant_group_is_exactly_zero_even_without_eps():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 2.0, 3.0], dtype=torch.float64)  # mean of three 0.1 is not 0.1
    adv, _ = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), eps=0.0)
    assert torch.equal(adv[:3], torch.zeros(3)) and torch.isfinite(adv).all()


def test_constant_group_and_single_valid_give_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 3.0, float("nan"), float("nan"), float("nan")])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, _ = group_advantages(rewards, groups)
    assert torch.equal(adv, torch.zeros(8))


def test_clamp_and_groups_spanning_ranks_in_any_order():
    rewards = torch.tensor([0.0] * 99 + [1.0])
    groups = torch.zeros(100, dtype=torch.long)
    adv, _ = group_advantages(rewards, groups, adv_clip_max=5.0)
    assert adv.max().item() == pytest.approx(5.0)  # unclamped it would be ~9.95
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    r, gid = torch.arange(8.0), torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    a, _ = group_advantages(r, gid)
    b, _ = group_advantages(r[perm], gid[perm])
    torch.testing.assert_close(a[perm], b)


def test_shape_mismatch_fails():
    with pytest.raises(ValueError, match="equal 1-D"):
        group_advantages(torch.zeros(4), torch.zeros(3))


def test_lower_clamp():
    rewards = torch.tensor([1.0] * 99 + [0.0])  # the outlier is (0 - 0.99) / 0.0995 = -9.95 std below the mean
    adv, _ = group_advantages(rewards, torch.zeros(100, dtype=torch.long), adv_clip_max=5.0)
    assert adv.min().item() == pytest.approx(-5.0)
    assert adv[:99].tolist() == pytest.approx([0.01 / np.std([1.0] * 99 + [0.0])] * 99, rel=1e-5)
    adv3, _ = group_advantages(rewards, torch.zeros(100, dtype=torch.long), adv_clip_max=3.0)
    assert adv3.min().item() == pytest.approx(-3.0)


def test_near_constant_group_does_not_blow_rounding_noise_up():
    # two rewards 1e-12 apart (float noise of a reward model): the eps keeps their advantages tiny instead of +-1
    rewards = torch.tensor([1.0, 1.0 + 1e-12, 2.0, 3.0], dtype=torch.float64)
    adv, _ = group_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    assert adv[:2].abs().max().item() < 1e-3
    assert adv[2:].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)  # a real spread still gives full size
