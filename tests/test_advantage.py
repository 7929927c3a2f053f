import math

import numpy as np
import pytest
import torch

from sage_grpo.advantage import combine_components, group_advantages


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


def test_a_group_that_differs_by_float32_rounding_only_gets_zero_advantages():
    """float32 rewards one or two ulps apart (the same score from another batch composition) are one value: +-1
    advantages for them would train rounding noise. A real difference of 1e-4 relative still gets full size."""
    v = torch.tensor(0.7312345, dtype=torch.float32)
    up = torch.nextafter(v, torch.tensor(2.0))
    noisy = torch.stack([v, up, v, torch.nextafter(up, torch.tensor(2.0))]).double()
    adv, _ = group_advantages(noisy, torch.zeros(4, dtype=torch.long))
    assert torch.equal(adv, torch.zeros(4))
    real = torch.stack([v, v * (1 + 1e-4), v, v * (1 + 1e-4)]).double()
    adv, _ = group_advantages(real, torch.zeros(4, dtype=torch.long))
    assert adv.tolist() == pytest.approx([-1.0, 1.0, -1.0, 1.0], abs=1e-3)


def _authors_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """The authors' group normalisation of one group, transcribed: (r - mean) / max(population std, 1e-6)."""
    r = rewards.double()
    return (r - r.mean()) / r.std(unbiased=False).clamp_min(1e-6)


def test_a_nearly_tied_group_against_the_authors_floor():
    """docs/algorithm.md "What we do differently": the authors divide by max(std, 1e-6), we by std + 1e-8 with 0 for
    a group constant up to float32 rounding. They differ only where a group's std is below 1e-6: four evenly spaced
    rewards of population std 1.1e-7 give +-0.15 (authors) and +-1.23 (ours); float32 rewards one ulp apart
    give +-0.06 and 0. With a std of 1e-6 and above they agree to 1e-2 relative (the 1e-8)."""
    group = torch.zeros(4, dtype=torch.long)
    step = 1.1e-7 / math.sqrt(1.25)  # [0, d, 2d, 3d]: population std sqrt(1.25) d
    spaced = torch.arange(4, dtype=torch.float64) * step
    ours, _ = group_advantages(spaced, group)
    assert float(spaced.std(unbiased=False)) == pytest.approx(1.1e-7, rel=1e-9)
    assert float(_authors_advantages(spaced).max()) == pytest.approx(0.15, abs=0.005)
    assert float(ours.max()) == pytest.approx(1.23, abs=0.005)
    one = torch.tensor(1.0)
    ulp = torch.stack([one, torch.nextafter(one, torch.tensor(2.0))] * 2).double()  # float32 1 and 1 + 2^-23
    ours, _ = group_advantages(ulp, group)
    assert float(_authors_advantages(ulp).max()) == pytest.approx(0.06, abs=0.005)
    assert torch.equal(ours, torch.zeros(4))
    for std in (1e-6, 1e-3, 1.0):
        wide = torch.arange(4, dtype=torch.float64) * std / math.sqrt(1.25)
        ours, _ = group_advantages(wide, group)
        torch.testing.assert_close(ours.double(), _authors_advantages(wide), rtol=1e-2, atol=0)


# ------------------------------------------------------------------------------ combining the reward components

def _combine_reference(scores, weights, required, groups, normalize, eps=1e-8):
    """Per-sample Python loops over plain lists: masked = a required weighted score failed or none is left; within
    a group's unmasked samples, sum: a failed optional score is the mean of the others; normalize: z-scores with the
    population std, 0 for a failed optional score or a component constant up to float32 rounding."""
    n, k = len(scores), len(weights)
    fin = [[math.isfinite(scores[i][j]) for j in range(k)] for i in range(n)]
    used = [w != 0 for w in weights]
    masked = [any(used[j] and required[j] and not fin[i][j] for j in range(k))
              or not any(used[j] and fin[i][j] for j in range(k)) for i in range(n)]
    out = [math.nan] * n
    for i in range(n):
        if masked[i]:
            continue
        mates = [m for m in range(n) if groups[m] == groups[i] and not masked[m]]
        s = 0.0
        for j in range(k):
            if not used[j]:
                continue
            have = [scores[m][j] for m in mates if fin[m][j]]
            mean = sum(have) / len(have) if have else 0.0
            if normalize:
                std = math.sqrt(sum((x - mean) ** 2 for x in have) / len(have)) if have else 0.0
                flat = len(have) < 2 or std <= 16 * 2.0 ** -23 * max(abs(x) for x in have)  # float32 rounding
                z = 0.0 if not fin[i][j] or flat else (scores[i][j] - mean) / (std + eps)
                s += weights[j] * z
            else:
                s += weights[j] * (scores[i][j] if fin[i][j] else mean)
        out[i] = s
    return out


NAN = float("nan")
# 2 groups of 4; components: A (required, w 1), B (optional, w 0.5, ~100x A's scale), C (required, w 0: logged only)
SCORES = [[0.1, 250.0, NAN], [0.4, NAN, 1.0], [0.3, 120.0, 2.0], [NAN, 300.0, 3.0],
          [0.2, 180.0, 0.0], [0.2, 90.0, 0.0], [0.9, NAN, 0.0], [0.5, 60.0, 0.0]]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
WEIGHTS, REQUIRED = [1.0, 0.5, 0.0], [True, False, True]


@pytest.mark.parametrize("normalize", [False, True])
def test_combine_components_matches_reference_loops(normalize):
    out = combine_components(torch.tensor(SCORES, dtype=torch.float64), torch.tensor(WEIGHTS), torch.tensor(REQUIRED),
                             torch.tensor(GROUPS), normalize=normalize)
    ref = _combine_reference(SCORES, WEIGHTS, REQUIRED, GROUPS, normalize)
    np.testing.assert_allclose(out.numpy(), np.array(ref), rtol=1e-12, atol=1e-12)
    # sample 3 lost required A: masked; samples 1 and 6 lost optional B only, sample 0 lost C (weight 0): trained
    assert torch.isnan(out).tolist() == [False, False, False, True, False, False, False, False]


def test_combine_components_by_hand():
    """The numbers written out. Group 0 without the masked sample 3: A = (0.1, 0.4, 0.3), B = (250, -, 120), B's
    mean 185 stands in for sample 1's. Sum: 0.1 + 125 = 125.1, 0.4 + 92.5 = 92.9, 0.3 + 60 = 60.3. Normalised:
    A's mean 0.8/3, population std sqrt(0.14/3 - (0.8/3)^2); B's z over (250, 120) is +-1 and 0 for sample 1."""
    args = (torch.tensor(SCORES, dtype=torch.float64), torch.tensor(WEIGHTS), torch.tensor(REQUIRED),
            torch.tensor(GROUPS))
    summed = combine_components(*args, normalize=False)
    np.testing.assert_allclose(summed[:3].numpy(), [125.1, 92.9, 60.3], rtol=1e-12)
    ma = 0.8 / 3
    sa = math.sqrt((0.1 ** 2 + 0.4 ** 2 + 0.3 ** 2) / 3 - ma ** 2)
    za = [(x - ma) / (sa + 1e-8) for x in (0.1, 0.4, 0.3)]
    normed = combine_components(*args, normalize=True)
    np.testing.assert_allclose(normed[:3].numpy(), [za[0] + 0.5, za[1], za[2] - 0.5], rtol=1e-9)
    # group 1: A = (0.2, 0.2, 0.9, 0.5) and B = (180, 90, -, 60); by the sum B (~100x A's scale) picks the best
    # (sample 4: 90.2 against 55.9 for sample 6, whose B counts as B's mean 110); normalised, A's clear best
    # (sample 6: z_A 1.57, z_B 0) wins against sample 4 (z_A -0.87 + 0.5 z_B 0.69)
    assert int(summed[4:].argmax()) == 0 and int(normed[4:].argmax()) == 2


def test_failed_required_component_masks_and_optional_does_not():
    scores = torch.tensor([[1.0, 2.0], [NAN, 3.0], [2.0, NAN], [4.0, 5.0]])  # one group, A and B both weighted
    groups, w = torch.zeros(4, dtype=torch.long), torch.tensor([1.0, 1.0])
    both = combine_components(scores, w, torch.tensor([True, True]), groups, normalize=False)
    assert torch.isnan(both).tolist() == [False, True, True, False]
    b_opt = combine_components(scores, w, torch.tensor([True, False]), groups, normalize=False)
    assert torch.isnan(b_opt).tolist() == [False, True, False, False]
    assert b_opt[2].item() == 2.0 + 3.5  # B's mean over samples 0 and 3 (sample 1 is masked: not in it)
    none_req = combine_components(torch.tensor([[NAN, NAN], [1.0, 2.0], [3.0, NAN]]), w,
                                  torch.tensor([False, False]), torch.zeros(3, dtype=torch.long), normalize=True)
    assert torch.isnan(none_req).tolist() == [True, False, False]  # nothing weighted left: masked


def test_combine_components_constant_component_gives_zero():
    # 0.7 three times: its float64 mean is off by 1e-16, which / (0 + eps) would be 1e-8 of noise, not 0
    scores = torch.tensor([[0.7, 7.0], [0.7, 8.0], [0.7, 9.0]], dtype=torch.float64)
    out = combine_components(scores, torch.tensor([1.0, 2.0]), torch.tensor([True, True]),
                             torch.zeros(3, dtype=torch.long), normalize=True)
    z = 1 / (math.sqrt(2 / 3) + 1e-8)
    assert out[1].item() == 0.0  # A contributes exactly nothing, B's middle sample is its mean
    np.testing.assert_allclose(out.numpy(), [-2 * z, 0.0, 2 * z], rtol=1e-12)


def test_combine_components_ulp_noise_is_constant_but_a_small_real_difference_is_not():
    """Float32 scores (as post_train passes them) that differ by one or two ulps within a group are rounding noise:
    component_norm gives them z = 0, not |z| ~ 1. A real difference of 1e-4 relative is still normalised."""
    v = torch.tensor([0.7, -3.25, 0.02], dtype=torch.float32)  # components A, B, C: three magnitudes, one negative
    inf = torch.full_like(v, math.inf)
    up = torch.nextafter(v, inf)
    noisy = torch.stack([v, up, v, torch.nextafter(up, inf)])  # [4, 3]: each component spread over 0..2 ulps
    assert bool((noisy != noisy[0]).any(dim=0).all())  # not exactly constant: the old check let it through
    w, req, groups = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([True] * 3), torch.zeros(4, dtype=torch.long)
    assert combine_components(noisy, w, req, groups, normalize=True).tolist() == [0.0] * 4
    real = torch.stack([v, v + v.abs() * 1e-4, v, v + v.abs() * 1e-4])  # 1e-4 relative (~840 ulps): real
    d = (real[1].double() - real[0].double()) / 2  # [3] each component's population std
    z = (d / (d + 1e-8)).sum().item()  # every component: z = -+ d / (d + eps) at the lower / upper samples
    out = combine_components(real, w, req, groups, normalize=True)
    np.testing.assert_allclose(out.numpy(), [-z, z, -z, z], rtol=1e-6)
    assert z > 2.9  # three components at |z| ~ 1 each
