import math
import re

import pytest
import torch
from torch.distributions import Normal

from sage_grpo.config import load_config
from sage_grpo.errors import SageGRPOError
from sage_grpo.schedule import sigma_schedule
from sage_grpo.sde import SAGE_SIGMA_CLAMP, SAMPLERS, check_sage_schedule, check_sampler, sde_step, step_variance

SDES = ["dance_grpo", "flow_grpo", "sage_grpo", "cps"]
SIG = sigma_schedule(20, 5.0)

# README "The samplers": std per step, T = 20, shift 5, eta = 0.5
STD_TABLE_STEPS = [0, 1, 2, 5, 9, 14, 18, 19]
STD_TABLE = {
    "sage_grpo": [.556, .426, .331, .233, .190, .164, .122, .080],
    "flow_grpo": [.500, .519, .373, .248, .199, .174, .144, .117],
    "dance_grpo": [.051, .053, .056, .064, .081, .119, .193, .228],
    "cps": [.700, .692, .683, .651, .589, .442, .147, 0.0],
}


def _std_row(sde, eta=0.5):
    return [
        float(sde_step(sde, torch.zeros(1, 2), torch.zeros(1, 2), SIG[i].item(), SIG[i + 1].item(), eta,
                       sigma_max=SIG[1].item(), noise=torch.zeros(1, 2)).std)
        for i in range(20)
    ]


@pytest.mark.parametrize("sde", SDES)
def test_std_table(sde):
    row = _std_row(sde)
    got = [row[i] for i in STD_TABLE_STEPS]
    assert got == pytest.approx(STD_TABLE[sde], abs=6e-4)


def test_std_independent_formulas():
    # Direct transcription of the paper's Table 1 / Eq. 6 at step 3, independent of step_variance.
    eta, s, sn = 0.5, SIG[3].item(), SIG[4].item()
    want = eta * math.sqrt(-(s - sn) + math.log((1 - sn) / (1 - s)))
    assert _std_row("sage_grpo")[3] == pytest.approx(want, rel=1e-5)
    assert _std_row("flow_grpo")[3] == pytest.approx(eta * math.sqrt(s / (1 - s)) * math.sqrt(s - sn), rel=1e-5)
    assert _std_row("dance_grpo")[3] == pytest.approx(eta * math.sqrt(s - sn), rel=1e-5)
    assert _std_row("cps")[3] == pytest.approx(sn * math.sin(eta * math.pi / 2), rel=1e-5)


def test_sage_less_noise_than_flow_after_first_step():
    sage, flow = _std_row("sage_grpo"), _std_row("flow_grpo")
    assert sage[0] > flow[0]  # the clamp decides step 0
    assert all(a < b for a, b in zip(sage[1:], flow[1:]))


def test_sage_refuses_a_schedule_whose_first_step_the_clamp_would_silence():
    sig = sigma_schedule(100, 5.0)  # sigma_1 = 0.998 > 0.997
    with pytest.raises(SageGRPOError, match="would inject no noise.*use fewer steps"):
        sde_step("sage_grpo", torch.zeros(1, 2), torch.zeros(1, 2), sig[0].item(), sig[1].item(), 0.5)
    out = sde_step("sage_grpo", torch.zeros(1, 2), torch.zeros(1, 2), sig[0].item(), sig[1].item(), 0.5,
                   sage_clamp=0.999)
    assert out.std.item() > 0


def _sage_v(s, sn, clamp):
    """V_t / eta^2 of sage_grpo written out in Python floats (paper Eq. 5), independent of sage_grpo.sde."""
    return math.log((1 - sn) / (1 - min(s, clamp))) - (s - sn)


@pytest.mark.parametrize("shift", [0.5, 1.0, 2.0, 4.0, 5.0, 9.0])
def test_every_sage_schedule_the_config_accepts_injects_noise_on_every_step(shift):
    # The region: only step 0 can fail (sigma_t <= clamp makes the integral positive), and it fails once
    # 1 - sigma_1 = 1 / (shift (T - 1) + 1) is too small; the sweep straddles the boundary of every shift.
    for steps in (1, 2, 20, 50, 67, 68, 83, 84, 166, 167, 332, 333, 700):
        sig = sigma_schedule(steps, shift)
        expect_ok = _sage_v(1.0, 1.0 - 1.0 / (shift * (steps - 1) + 1), SAGE_SIGMA_CLAMP) > 0
        argv = ["--grpo_sampling_steps", str(steps), "--flow_shift", str(shift)]
        if not expect_ok:
            with pytest.raises(SageGRPOError, match=r"sage_grpo step 0 .* would inject no noise.*use fewer steps"):
                load_config(argv)
            continue
        load_config(argv)
        for i in range(steps):  # the rollout's path: fp64 schedule entries, fp32 math inside sde_step
            out = sde_step("sage_grpo", torch.zeros(1, 2), torch.zeros(1, 2), sig[i], sig[i + 1], 0.5,
                           noise=torch.zeros(1, 2))
            assert out.std.item() > 0 and out.log_prob.item() != 0, (steps, shift, i)


def test_sigma_next_at_the_clamp_is_refused():
    sig = sigma_schedule(20, 5.0)
    at = float(sig[1])  # a clamp exactly at sigma_1: the step's integral is -delta < 0
    with pytest.raises(SageGRPOError, match="step 0 .*would inject no noise"):
        load_config(["--sage_sigma_clamp", repr(at)])
    with pytest.raises(SageGRPOError, match="would inject no noise"):
        sde_step("sage_grpo", torch.zeros(1, 2), torch.zeros(1, 2), sig[0], sig[1], 0.5, sage_clamp=at)
    with pytest.raises(SageGRPOError, match="would inject no noise"):  # a zero-length step: V_t = 0
        sde_step("sage_grpo", torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.5, 0.5)
    # the smallest clamp with a positive integral is 1 - (1 - sigma_1) exp(-(1 - sigma_1)): just above it works
    above = 1 - (1 - at) * math.exp(-(1 - at)) + 1e-7
    assert _sage_v(1.0, at, above) > 0
    load_config(["--sage_sigma_clamp", repr(above)])
    out = sde_step("sage_grpo", torch.zeros(1, 2), torch.zeros(1, 2), sig[0], sig[1], 0.5, sage_clamp=above)
    assert out.std.item() > 0


def test_sage_refusal_names_the_step_and_the_fixes_and_they_work():
    with pytest.raises(SageGRPOError) as e:
        check_sage_schedule(84, 4.0)
    msg = str(e.value)
    assert "step 0" in msg and "84 steps, shift 4" in msg and "--sage_sigma_clamp 0.997" in msg
    steps = int(re.search(r"at most (\d+) with shift", msg).group(1))
    shift = float(re.search(r"a smaller shift \(at most ([0-9.]+)", msg).group(1))
    clamp = float(re.search(r"closer to 1 \(at least ([0-9.]+)", msg).group(1))
    for fixed in (["--grpo_sampling_steps", str(steps), "--flow_shift", "4"],
                  ["--grpo_sampling_steps", "84", "--flow_shift", str(shift)],
                  ["--grpo_sampling_steps", "84", "--flow_shift", "4", "--sage_sigma_clamp", str(clamp)]):
        load_config(fixed)
    assert steps == 83  # 1 - sigma_1 = 1 / (4 * 82 + 1) leaves a positive integral, 1 / (4 * 83 + 1) does not
    assert _sage_v(1.0, 1 - 1 / (4 * 82 + 1), SAGE_SIGMA_CLAMP) > 0
    assert _sage_v(1.0, 1 - 1 / (4 * 83 + 1), SAGE_SIGMA_CLAMP) < 0


def test_sage_variance_stays_positive_at_the_end_of_long_low_shift_schedules():
    # Near sigma = 0 the two terms of the integral cancel to ~ sigma * delta; the plain fp32 form rounded it to
    # <= 0 on such schedules (e.g. 155 steps with shift 0.05), silently dropping the last steps' noise.
    for steps, shift in ((155, 0.05), (309, 0.1), (1000, 0.2)):
        check_sage_schedule(steps, shift)
        sig = sigma_schedule(steps, shift)
        for i in range(steps - 3, steps):
            out = sde_step("sage_grpo", torch.zeros(1, 2), torch.zeros(1, 2), sig[i], sig[i + 1], 0.5,
                           noise=torch.zeros(1, 2))
            s, sn = float(sig[i]), float(sig[i + 1])
            ref = 0.25 * (math.log1p((s - sn) / (1 - s)) - (s - sn))
            assert out.std.item() ** 2 == pytest.approx(ref, rel=1e-3), (steps, shift, i)


def test_sage_clamp_is_configurable():
    a = step_variance("sage_grpo", torch.tensor(1.0), torch.tensor(0.99), 0.5)
    b = step_variance("sage_grpo", torch.tensor(1.0), torch.tensor(0.99), 0.5, sage_clamp=0.999)
    assert SAGE_SIGMA_CLAMP == pytest.approx(0.997)
    assert torch.isfinite(a) and b > a


def _reference_mean(sde, x, v, s, sn, eta, sigma_max):
    """The peers' formulas, written out independently (FlowGRPO / DanceGRPO / CPS)."""
    dt = sn - s
    if sde == "flow_grpo":
        std_dev_t = math.sqrt(s / (1 - (sigma_max if s == 1 else s))) * eta
        return x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    if sde == "dance_grpo":
        x0 = x - s * v
        score = -(x - x0 * (1 - s)) / s**2
        return x + dt * v + (-0.5 * eta**2 * score) * dt
    if sde == "sage_grpo":
        var = eta**2 * (math.log((1 - sn) / (1 - min(s, SAGE_SIGMA_CLAMP))) - (s - sn))
        x1 = x + (1 - s) * v
        return x + v * dt - var / (2 * s) * x1
    std = sn * math.sin(eta * math.pi / 2)
    return (x - s * v) * (1 - sn) + (x + v * (1 - s)) * math.sqrt(sn**2 - std**2)


@pytest.mark.parametrize("sde", SDES)
@pytest.mark.parametrize("step", [0, 7, 19])
def test_mean_and_log_prob_against_independent_computation(sde, step):
    g = torch.Generator().manual_seed(step)
    x, v = torch.randn(3, 4, 5, 6, generator=g), torch.randn(3, 4, 5, 6, generator=g)
    s, sn = SIG[step].item(), SIG[step + 1].item()
    out = sde_step(sde, v, x, s, sn, 0.5, sigma_max=SIG[1].item(), generator=g, cps_logprob="normalized")
    mean = _reference_mean(sde, x.double(), v.double(), s, sn, 0.5, SIG[1].item())
    torch.testing.assert_close(out.mean.double(), mean, atol=2e-5, rtol=1e-5)
    if float(out.std[0]) > 0:
        ref = Normal(out.mean.double(), out.std[0].double()).log_prob(out.prev_sample.double()).mean(dim=(1, 2, 3))
        torch.testing.assert_close(out.log_prob.double(), ref, atol=1e-4, rtol=1e-5)
    else:  # cps last step: deterministic, no policy gradient
        torch.testing.assert_close(out.prev_sample, out.mean)
        assert torch.all(out.log_prob == 0)


def test_cps_peer_log_prob():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    out = sde_step("cps", v, x, SIG[4].item(), SIG[5].item(), 0.5, generator=g)
    torch.testing.assert_close(out.log_prob, (-((out.prev_sample - out.mean) ** 2)).mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("sde", SDES)
def test_eta_zero_is_euler_ode(sde):
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 3, 4, 4, generator=g)
    for i in (0, 5, 19):
        s, sn = SIG[i].item(), SIG[i + 1].item()
        out = sde_step(sde, v, x, s, sn, 0.0, sigma_max=SIG[1].item(), generator=g)
        torch.testing.assert_close(out.prev_sample, x + v * (sn - s), atol=1e-6, rtol=1e-6)
        ode = sde_step("ode", v, x, s, sn, 0.5)
        torch.testing.assert_close(ode.prev_sample, x + v * (sn - s), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("sde", SDES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 6, 6), (2, 4, 3, 6, 6)])
def test_rescoring_stored_sample_gives_ratio_one(sde, dtype, shape):
    g = torch.Generator().manual_seed(7)
    x, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    for i in (0, 10, 18):
        s, sn = SIG[i].item(), SIG[i + 1].item()
        roll = sde_step(sde, v, x, s, sn, 0.5, sigma_max=SIG[1].item(), generator=g)
        assert roll.prev_sample.dtype == dtype and roll.log_prob.dtype == torch.float32
        again = sde_step(sde, v, x, s, sn, 0.5, sigma_max=SIG[1].item(), prev_sample=roll.prev_sample)
        assert torch.equal(torch.exp(again.log_prob - roll.log_prob), torch.ones(shape[0]))


def test_bf16_inputs_use_fp32_math():
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    noise = torch.randn(2, 4, 8, 8, generator=g)
    lo = sde_step("sage_grpo", v.bfloat16(), x.bfloat16(), 0.9, 0.8, 0.5, noise=noise)
    hi = sde_step("sage_grpo", v.bfloat16().float(), x.bfloat16().float(), 0.9, 0.8, 0.5, noise=noise)
    assert lo.mean.dtype == torch.float32
    torch.testing.assert_close(lo.mean, hi.mean)


@pytest.mark.parametrize("sde", SDES)
def test_per_sample_sigmas_equal_separate_calls(sde):
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(3, 4, 2, 5, 5, generator=g), torch.randn(3, 4, 2, 5, 5, generator=g)
    noise = torch.randn(3, 4, 2, 5, 5, generator=g)
    idx = [0, 6, 17]
    s, sn = SIG[idx].float(), SIG[[i + 1 for i in idx]].float()
    batched = sde_step(sde, v, x, s, sn, 0.5, sigma_max=SIG[1].item(), noise=noise)
    for b in range(len(idx)):
        one = sde_step(sde, v[b:b + 1], x[b:b + 1], s[b].item(), sn[b].item(), 0.5, sigma_max=SIG[1].item(),
                       noise=noise[b:b + 1])
        torch.testing.assert_close(batched.prev_sample[b:b + 1], one.prev_sample)
        torch.testing.assert_close(batched.log_prob[b:b + 1], one.log_prob)
        torch.testing.assert_close(batched.std[b:b + 1], one.std)


@pytest.mark.parametrize("sde", SDES)
def test_empirical_variance_matches_std(sde):
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(1, 20000, generator=g).expand(8, -1), torch.randn(1, 20000, generator=g).expand(8, -1)
    out = sde_step(sde, v, x, SIG[8].item(), SIG[9].item(), 0.7, sigma_max=SIG[1].item(), generator=g)
    emp = (out.prev_sample - out.mean).var()
    assert emp.item() == pytest.approx(out.std[0].item() ** 2, rel=0.02)


def test_per_sample_generators_are_reproducible_and_independent_of_batch():
    x, v = torch.zeros(2, 3, 4, 4), torch.ones(2, 3, 4, 4)
    gens = [torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)]
    both = sde_step("sage_grpo", v, x, 0.8, 0.7, 0.5, generator=gens)
    alone = sde_step("sage_grpo", v[1:], x[1:], 0.8, 0.7, 0.5, generator=[torch.Generator().manual_seed(11)])
    torch.testing.assert_close(both.prev_sample[1:], alone.prev_sample)
    assert not torch.equal(both.prev_sample[0], both.prev_sample[1])
    with pytest.raises(ValueError, match="generators"):
        sde_step("sage_grpo", v, x, 0.8, 0.7, 0.5, generator=gens[:1])


def test_errors_name_valid_choices():
    assert check_sampler("cps") == "cps"
    with pytest.raises(ValueError, match="valid samplers: " + ", ".join(SAMPLERS)):
        sde_step("grpo", torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.4, 0.5)
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step("flow_grpo", torch.zeros(1, 2), torch.zeros(1, 2), 1.0, 0.9, 0.5)
    with pytest.raises(ValueError, match="cps_logprob"):
        sde_step("cps", torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.4, 0.5, cps_logprob="x")


# ------------------------------------------------------------------ marginal preservation with an exact velocity

MU, S_DATA = 2.0, 0.5


def _exact_velocity(x, sigma, data_std=S_DATA):
    """E[eps - x0 | x_sigma = x] for x0 ~ N(MU, data_std^2), x_sigma = (1 - sigma) x0 + sigma eps (closed form)."""
    var = (1 - sigma) ** 2 * data_std**2 + sigma**2
    d = x - (1 - sigma) * MU
    return sigma / var * d - (MU + (1 - sigma) * data_std**2 / var * d)


def _run(sde, steps, shift, n=40000, data_std=S_DATA, eta=0.5, stop=None):
    sig = sigma_schedule(steps, shift).tolist()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, generator=g)
    for i in range(steps if stop is None else stop):
        out = sde_step(sde, _exact_velocity(x, sig[i], data_std), x, sig[i], sig[i + 1], eta, sigma_max=sig[1],
                       generator=g)
        x = out.prev_sample
    return x, sig


@pytest.mark.parametrize("sde", ["ode", "dance_grpo", "flow_grpo", "sage_grpo"])
def test_marginal_preserving_samplers_end_at_the_data_distribution(sde):
    # Tolerance: 0.02 on the mean and the std of 40k samples after 100 uniform steps (Euler error + sampling noise).
    x, _ = _run(sde, 100, 1.0)
    assert x.mean().item() == pytest.approx(MU, abs=0.02)
    assert x.std().item() == pytest.approx(S_DATA, abs=0.02)


def test_cps_preserves_coefficients_and_the_mean():
    # CPS re-noises a fixed fraction of the predicted noise every step and uses the posterior-mean prediction,
    # so it keeps the mean but not the spread of a broad data distribution; it is exact when x0_hat is exact
    # (point-mass data): then every intermediate marginal is N((1 - sigma) mu, sigma^2).
    x, _ = _run("cps", 100, 1.0)
    assert x.mean().item() == pytest.approx(MU, abs=0.02)
    x, sig = _run("cps", 20, 5.0, data_std=0.0, stop=12)
    assert x.mean().item() == pytest.approx((1 - sig[12]) * MU, abs=0.01)
    assert x.std().item() == pytest.approx(sig[12], rel=0.02)
