import pytest
import torch

from sage_grpo.loss import clipped_policy_loss


def test_loss_matches_elementwise_formula():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(16, generator=g)
    new = old + 3e-4 * torch.randn(16, generator=g)
    adv = torch.randn(16, generator=g)
    w = torch.rand(16, generator=g) + 0.5
    loss, stats = clipped_policy_loss(new, old, adv, 1e-4, weights=w)
    ref = []
    for n, o, a, s in zip(new.tolist(), old.tolist(), adv.tolist(), w.tolist()):
        r = torch.exp(torch.tensor(n - o, dtype=torch.float64)).item()
        ref.append(s * max(-a * r, -a * min(max(r, 1 - 1e-4), 1 + 1e-4)))
    assert loss.item() == pytest.approx(sum(ref) / 16, rel=1e-4)
    ratio = torch.exp(new - old)
    assert stats.clipfrac == pytest.approx(((ratio - 1).abs() > 1e-4).float().mean().item())
    assert stats.approx_kl == pytest.approx(0.5 * ((new - old) ** 2).mean().item(), rel=1e-5)
    assert stats.ratio_max == pytest.approx(ratio.max().item())
    assert stats.ratio_min == pytest.approx(ratio.min().item())


def test_gradient_is_zero_exactly_for_clipped_entries():
    old = torch.zeros(4)
    new = torch.tensor([0.5, -0.5, 0.5, -0.5], requires_grad=True)  # ratios e^0.5 (above) and e^-0.5 (below)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, stats = clipped_policy_loss(new, old, adv, 0.2)
    loss.backward()
    # A > 0, ratio above 1 + eps: clipped (no gradient); A > 0, ratio below 1 - eps: unclipped (pessimistic bound)
    # A < 0, ratio above: unclipped; A < 0, ratio below: clipped.
    assert new.grad[0] == 0 and new.grad[3] == 0
    assert new.grad[1] != 0 and new.grad[2] != 0
    assert stats.clipfrac == 1.0


def test_ratio_one_gives_minus_mean_advantage_and_policy_gradient():
    old = torch.randn(6, generator=torch.Generator().manual_seed(2))
    new = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.0, 0.5, -0.5])
    loss, stats = clipped_policy_loss(new, old, adv, 1e-4)
    loss.backward()
    assert loss.item() == pytest.approx(-adv.mean().item())
    torch.testing.assert_close(new.grad, -adv / 6)
    assert stats.ratio_mean == 1.0 and stats.clipfrac == 0.0


def test_mask_removes_entries():
    old, new = torch.zeros(4), torch.zeros(4, requires_grad=True)
    adv = torch.tensor([1.0, 2.0, 100.0, 3.0])
    loss, _ = clipped_policy_loss(new, old, adv, 0.1, mask=torch.tensor([True, True, False, True]))
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    assert new.grad[2] == 0
    empty, _ = clipped_policy_loss(new, old, adv, 0.1, mask=torch.zeros(4, dtype=torch.bool))
    assert empty.item() == 0.0 and empty.requires_grad


def test_masked_entries_cannot_poison_the_loss_or_its_gradient():
    old = torch.zeros(4)
    new = torch.tensor([0.0, 0.0, 200.0, 0.0], requires_grad=True)  # exp(200) overflows to inf in fp32
    adv = torch.tensor([1.0, -1.0, float("nan"), 0.5])
    mask = torch.tensor([True, True, False, True])
    weights = torch.tensor([1.0, 1.0, float("inf"), 2.0])
    loss, stats = clipped_policy_loss(new, old, adv, 0.1, mask=mask, weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx((-1.0 + 1.0 - 1.0) / 3)
    assert torch.isfinite(new.grad).all() and new.grad[2] == 0
    torch.testing.assert_close(new.grad, torch.tensor([-1.0, 1.0, 0.0, -1.0]) / 3)
    assert stats.ratio_max == 1.0 and stats.approx_kl == 0.0 and stats.clipfrac == 0.0  # stats ignore the dropped entry


def test_stats_with_broadcast_shapes_and_mask():
    old = torch.zeros(2, 1)
    new = torch.tensor([[0.0], [0.5]])  # [B, 1] per sample, broadcast over T = 3 weights
    loss, stats = clipped_policy_loss(new, old, torch.ones(2, 1), 0.1, weights=torch.ones(1, 3),
                                      mask=torch.tensor([[True], [False]]))
    assert stats.ratio_max == 1.0 and stats.clipfrac == 0.0
    assert loss.item() == pytest.approx(-1.0)


def test_logp_old_never_receives_a_gradient():
    old = torch.tensor([0.1, -0.2, 0.3], requires_grad=True)  # e.g. re-scored under the same graph by mistake
    new = torch.tensor([0.1, -0.1, 0.2], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, _ = clipped_policy_loss(new, old * 1.0, adv, 0.2)  # old * 1.0: a non-leaf that requires grad
    loss.backward()
    assert old.grad is None and new.grad is not None and new.grad.abs().sum() > 0


def test_ratio_stats_ignore_masked_entries():
    old = torch.zeros(4)
    new = torch.tensor([0.05, 0.3, 0.0, 0.1])  # ratios 1.051, 1.350, 1, 1.105; the 1 is masked out
    mask = torch.tensor([True, True, False, True])
    _, stats = clipped_policy_loss(new, old, torch.ones(4), 0.2, mask=mask)
    kept = torch.exp(new[mask].double())
    assert stats.ratio_min == pytest.approx(kept.min().item(), rel=1e-6)
    assert stats.ratio_mean == pytest.approx(kept.mean().item(), rel=1e-6)
    assert stats.ratio_max == pytest.approx(kept.max().item(), rel=1e-6)
    assert stats.clipfrac == pytest.approx(1 / 3)  # only 1.35 leaves [0.8, 1.2], out of 3 kept entries
    assert stats.approx_kl == pytest.approx(0.5 * (0.05**2 + 0.3**2 + 0.1**2) / 3, rel=1e-5)
