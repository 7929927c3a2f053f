import pytest
import torch

from sage_grpo.equalizer import equalizer_weights, gradient_scale
from sage_grpo.schedule import sigma_schedule
from sage_grpo.sde import sde_step

SIG = sigma_schedule(20, 5.0)
# README "The rest of the algorithm", T = 20, shift 5, eta = 0.5, sage_grpo
SAGE_S = [8.15, 5.30, 3.73, 2.90, 2.35, 1.95, 1.64, 1.39, 1.18, 1.00, .846, .712, .594, .490, .397, .315, .241,
          .175, .115, .055]


def test_sage_weights_match_algorithm_table():
    s = equalizer_weights("sage_grpo", SIG, 0.5)
    assert s.shape == (20,)
    assert s.tolist() == pytest.approx(SAGE_S, abs=6e-3)


def _autograd_scale(sde, i, eta):
    """N_t from autograd: d mean / d v through sde_step (the mean is linear in v), over the step's std."""
    v = torch.zeros(1, 1, dtype=torch.float32, requires_grad=True)
    x = torch.ones(1, 1)
    out = sde_step(sde, v, x, SIG[i].item(), SIG[i + 1].item(), eta, sigma_max=SIG[1].item(), noise=torch.zeros(1, 1))
    (grad,) = torch.autograd.grad(out.mean.sum(), v)
    return grad.abs().item() / out.std.item() if out.std.item() > 0 else 1.0


@pytest.mark.parametrize("sde", ["dance_grpo", "flow_grpo", "sage_grpo", "cps"])
def test_gradient_scale_equals_autograd_sensitivity(sde):
    n = gradient_scale(sde, SIG, 0.5, cps_logprob="normalized")
    ref = [_autograd_scale(sde, i, 0.5) for i in range(20)]
    assert n.tolist() == pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize("sde", ["dance_grpo", "flow_grpo", "sage_grpo", "cps"])
@pytest.mark.parametrize("cps_logprob", ["peer", "normalized"])
def test_log_prob_gradient_norms_are_proportional_to_the_scale(sde, cps_logprob):
    # The quantity the equalizer exists for: ||d log_prob / d v|| of the log-prob sde_step really returns, measured
    # by autograd with the same noise on every step, divided by N_t, must be one constant across the steps.
    g = torch.Generator().manual_seed(0)
    x, xi = torch.randn(1, 4, 3, 8, 8, generator=g), torch.randn(1, 4, 3, 8, 8, generator=g)
    v0 = torch.randn(1, 4, 3, 8, 8, generator=g)
    n = gradient_scale(sde, SIG, 0.5, cps_logprob=cps_logprob)
    ratios = []
    for i in range(19 if sde == "cps" else 20):  # the last cps step is deterministic (no gradient)
        args = (x, SIG[i].item(), SIG[i + 1].item(), 0.5)
        drawn = sde_step(sde, v0, *args, sigma_max=SIG[1].item(), noise=xi).prev_sample  # the rollout sample
        v = v0.clone().requires_grad_(True)
        out = sde_step(sde, v, *args, sigma_max=SIG[1].item(), prev_sample=drawn, cps_logprob=cps_logprob)
        (grad,) = torch.autograd.grad(out.log_prob.sum(), v)
        ratios.append(grad.double().norm().item() / n[i].item())
    assert max(ratios) / min(ratios) == pytest.approx(1.0, abs=1e-3)


def test_cps_peer_scale_grows_with_the_noise():
    peer = gradient_scale("cps", SIG, 0.5)
    normalized = gradient_scale("cps", SIG, 0.5, cps_logprob="normalized")
    var = (SIG[1:-1] * torch.sin(torch.tensor(0.5 * torch.pi / 2, dtype=torch.float64))) ** 2
    torch.testing.assert_close(peer[:-1] / normalized[:-1], var)  # ratio of the two proxies = V_t
    with pytest.raises(ValueError, match="cps_logprob"):
        gradient_scale("cps", SIG, 0.5, cps_logprob="gauss")


@pytest.mark.parametrize("sde", ["dance_grpo", "flow_grpo", "sage_grpo", "cps"])
def test_weights_are_median_over_scale(sde):
    n = gradient_scale(sde, SIG, 0.5)
    s = equalizer_weights(sde, SIG, 0.5)
    lower_median = sorted(n.tolist())[(len(n) - 1) // 2]  # even count: the lower middle value
    torch.testing.assert_close(s.double(), lower_median / (n + 1e-8), rtol=1e-6, atol=0)
    assert (s * n.float()).tolist() == pytest.approx([lower_median] * 20, rel=1e-5)


def test_guards_give_unit_scale():
    n = gradient_scale("sage_grpo", SIG, 0.0)  # V = 0 everywhere
    assert torch.all(n == 1)
    assert equalizer_weights("sage_grpo", SIG, 0.0).tolist() == pytest.approx([1.0] * 20)
    assert gradient_scale("cps", SIG, 0.5)[-1] == 1  # cps injects no noise on the last step
    assert torch.all(gradient_scale("ode", SIG, 0.5) == 1)


def test_weights_equalize_a_spread_of_more_than_an_order_of_magnitude():
    n = gradient_scale("flow_grpo", SIG, 0.5)
    s = equalizer_weights("flow_grpo", SIG, 0.5)
    assert n.max() / n.min() > 10
    balanced = s.double() * n
    assert balanced.max() / balanced.min() < 1.0 + 1e-6


def test_equalizer_honours_a_non_default_sage_clamp():
    import math

    clamp, eta = 0.9995, 0.5
    s1 = SIG[1].item()
    v0 = eta**2 * (math.log((1 - s1) / (1 - clamp)) - (1 - s1))  # step 0, written out (sigma_0 = 1 is clamped)
    n = gradient_scale("sage_grpo", SIG, eta, sage_clamp=clamp)
    assert n[0].item() == pytest.approx(abs(s1 - 1.0) / math.sqrt(v0), rel=1e-6)  # d mean / d v = dt at sigma 1
    default = gradient_scale("sage_grpo", SIG, eta)
    torch.testing.assert_close(n[1:], default[1:])  # only the clamped step changes
    w = equalizer_weights("sage_grpo", SIG, eta, sage_clamp=clamp)
    assert w[0].item() == pytest.approx(torch.median(n).item() / n[0].item(), rel=1e-5)
    assert w[0].item() != pytest.approx(equalizer_weights("sage_grpo", SIG, eta)[0].item(), rel=1e-2)


def test_cps_last_step_weight_against_the_authors_floor():
    """docs/algorithm.md "What we do differently": cps's noise-free last step gets N_t = 1 (S_t 0.032 at T = 20,
    shift 5, eta = 0.5); the authors' floor of the std at 1e-12 gives N_t = |d mean/d v| / 1e-12 = 2.1e11 and
    S_t = 4.9e-13. Either way it is the largest N_t, so the median and every other weight are the same."""
    from sage_grpo.sde import mean_sensitivity, step_variance

    n = gradient_scale("cps", SIG, 0.5)
    s = equalizer_weights("cps", SIG, 0.5)
    assert n[-1] == 1 and s[-1].item() == pytest.approx(0.032, abs=5e-4)
    # the authors' cps proxy, transcribed: |d mean/d v| / max(s_t, 1e-12) on every step, S = median / N
    var = step_variance("cps", SIG[:-1], SIG[1:], 0.5)
    authors = mean_sensitivity("cps", SIG[:-1], SIG[1:], var).abs() / var.sqrt().clamp(min=1e-12)
    assert var[-1] == 0 and authors[-1].item() == pytest.approx(2.083e11, rel=1e-3)
    assert (torch.median(authors) / authors[-1]).item() == pytest.approx(4.9e-13, rel=1e-2)
    authors_n = authors[-1]
    floored = n.clone()
    floored[-1] = authors_n
    assert torch.median(floored) == torch.median(n)  # the other steps' weights do not move
