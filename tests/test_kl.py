import json

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from sage_grpo.kl import KL_VAR_EPS, AdaptiveKLController, dual_kl, kl_position, kl_velocity


def test_kl_position_is_the_gaussian_kl():
    g = torch.Generator().manual_seed(0)
    m1, m2 = torch.randn(3, 4, 2, 5, 5, generator=g), torch.randn(3, 4, 2, 5, 5, generator=g)
    var = torch.tensor([0.3, 0.01, 0.0])
    ours = kl_position(m1, m2, var)
    std = (var + KL_VAR_EPS).sqrt().reshape(3, 1, 1, 1, 1)
    ref = kl_divergence(Normal(m1, std), Normal(m2, std)).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert torch.all(ours >= 0)
    assert torch.all(kl_position(m1, m1, var) == 0)
    torch.testing.assert_close(kl_position(m1, m2, 0.3), kl_position(m1, m2, torch.full((3,), 0.3)))


def test_kl_velocity_and_dual_combination():
    old = torch.tensor([0.1, 0.2])
    new = torch.tensor([0.05, 0.3], requires_grad=True)
    vel = kl_velocity(old, new)
    torch.testing.assert_close(vel, torch.tensor([0.05, -0.1]))
    pos = torch.tensor([2.0, 4.0])
    total = dual_kl(pos, vel, beta_pos=1.0, beta_vel=0.1)
    assert total.item() == pytest.approx(3.0 + 0.1 * (-0.025))
    assert dual_kl(None, vel, beta_vel=0.1).item() == pytest.approx(-0.0025)
    assert dual_kl(pos, None).item() == pytest.approx(3.0)
    total.backward()
    torch.testing.assert_close(new.grad, torch.tensor([-0.05, -0.05]))
    with pytest.raises(ValueError):
        dual_kl(None, None)


def test_dual_kl_sum_reduction_and_empty_terms():
    pos, vel = torch.tensor([2.0, 4.0, 0.0]), torch.tensor([0.05, -0.1, 0.0])
    assert dual_kl(pos, vel, beta_pos=1.0, beta_vel=0.1, reduction="sum").item() == pytest.approx(6.0 - 0.005)
    assert dual_kl(pos, vel, beta_pos=1.0, beta_vel=0.1).item() == pytest.approx(2.0 - 0.005 / 3)
    empty = torch.zeros(0)  # every reward of the micro-batch failed: the term counts 0, not NaN
    assert dual_kl(empty, vel, beta_vel=0.1, reduction="mean").item() == pytest.approx(-0.005 / 3)
    assert dual_kl(empty, None, reduction="sum").item() == 0.0
    with pytest.raises(ValueError, match="reduction"):
        dual_kl(pos, vel, reduction="max")


def test_controller_warmup_is_linear_in_updates():
    c = AdaptiveKLController(init=1e-7, lambda_min=1e-7, lambda_max=1e-5, target=1e-5, warmup_updates=100)
    assert c.value == pytest.approx(1e-7)
    seen = [c.update(0.0) for _ in range(100)]
    for k, v in enumerate(seen, start=1):
        assert v == pytest.approx(1e-7 + (1e-5 - 1e-7) * k / 100)
    assert c.value == pytest.approx(1e-5)


@pytest.mark.parametrize("direction,high,low", [("paper", 0.9, 1.1), ("classic", 1.1, 0.9)])
def test_controller_feedback_rule_and_bounds(direction, high, low):
    c = AdaptiveKLController(init=1e-7, lambda_min=1e-7, lambda_max=1e-5, target=1e-3, warmup_updates=2,
                             history=3, direction=direction)
    c.update(0.0)
    c.update(0.0)
    start = c.value  # = lambda_max after warm-up
    c.update(1.0)  # history mean (0 + 0 + 1) / 3 = 0.33 > 1.5 target
    assert c.value == pytest.approx(min(start * high, 1e-5))
    c2 = AdaptiveKLController(init=1e-6, lambda_min=1e-7, lambda_max=1e-5, target=1e-3, warmup_updates=0,
                              history=3, direction=direction)
    v0 = c2.value
    c2.update(1e-3)  # inside [0.5, 1.5] target: unchanged
    assert c2.value == v0
    c2.update(-1.0)  # mean (1e-3 - 1) / 2 < 0.5 target
    assert c2.value == pytest.approx(min(max(v0 * low, 1e-7), 1e-5))
    for _ in range(200):
        c2.update(5.0 if direction == "paper" else -5.0)
    assert c2.value == pytest.approx(1e-7)  # clipped at lambda_min


def test_controller_state_round_trip_continues_identically():
    a = AdaptiveKLController(warmup_updates=3, history=4, target=1e-4)
    kls = [1e-3, 2e-4, 5e-5, 1e-6, 3e-3, 3e-3, 1e-7, 1e-7, 2e-4]
    for x in kls[:5]:
        a.update(x)
    state = json.loads(json.dumps(a.state_dict()))
    b = AdaptiveKLController(warmup_updates=3, history=4, target=1e-4)
    b.load_state_dict(state)
    assert b.state_dict() == state and b.kl_mean == a.kl_mean
    for x in kls[5:]:
        assert a.update(x) == b.update(x)
    assert a.state_dict() == b.state_dict()


def test_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="direction"):
        AdaptiveKLController(direction="sideways")
    with pytest.raises(ValueError, match="lambda_min"):
        AdaptiveKLController(lambda_min=1e-3, lambda_max=1e-5)


def test_controller_from_the_authors_flags():
    from sage_grpo.config import load_config

    c = AdaptiveKLController.from_config(load_config([]).kl)
    assert (c.init, c.lambda_min, c.lambda_max, c.target) == (1e-7, 1e-7, 1e-5, 1e-5)
    assert (c.warmup_updates, c.history, c.direction) == (100, 10, "paper")
    c2 = AdaptiveKLController.from_config(load_config(["--kl_target", "3e-6", "--kl_adapt_direction", "classic"]).kl)
    assert c2.target == 3e-6 and c2.lambda_max == 1e-5 and c2.direction == "classic"


@pytest.mark.parametrize("argv,variant,weights", [
    ([], "dual", (1.0, 0.1)),
    (["--kl_weight", "0"], "none", (0.0, 0.0)),
    (["--use_moving_KL", "False", "--use_dual_kl", "False"], "fixed", (1.0, 0.0)),
    (["--use_dual_kl", "False"], "moving", (1.0, 0.0)),
    (["--dual_kl_moving_weight", "0"], "stepwise", (0.0, 0.1)),
    (["--use_moving_KL", "no"], "dual_fixed", (1.0, 0.1)),
    (["--dual_kl_moving_weight", "2", "--dual_kl_step_weight", "0.5"], "dual", (2.0, 0.5)),
])
def test_kl_variants_from_flags(argv, variant, weights):
    from sage_grpo.config import load_config
    from sage_grpo.kl import KL_VARIANTS, kl_term_weights, kl_variant, uses_position_kl

    kl = load_config(argv).kl
    assert kl_variant(kl) == variant and variant in KL_VARIANTS
    assert kl_term_weights(kl) == weights
    assert uses_position_kl(kl) == (weights[0] > 0)  # an anchor model exactly when KL_pos has a weight


@pytest.mark.parametrize("direction,high,low", [("paper", 0.9, 1.1), ("classic", 1.1, 0.9)])
def test_controller_factors_from_inside_the_bounds(direction, high, low):
    def fresh():
        return AdaptiveKLController(init=1e-6, lambda_min=1e-7, lambda_max=1e-5, target=1e-3, warmup_updates=0,
                                    history=1, direction=direction)

    assert fresh().value == 1e-6  # no warm-up: starts at kl_coef
    c = fresh()
    c.update(1.0)  # far above target
    assert c.value == pytest.approx(1e-6 * high)
    c = fresh()
    c.update(0.0)  # far below target
    assert c.value == pytest.approx(1e-6 * low)


def test_controller_skips_non_finite_kl_and_kl_off_is_zero():
    from sage_grpo.config import load_config

    c = AdaptiveKLController(init=1e-6, warmup_updates=0, history=2, target=1e-3)
    c.update(1e-3)
    c.update(float("nan"))
    assert c.kl_mean == 1e-3 and c.num_updates == 2
    off = AdaptiveKLController.from_config(load_config(["--kl_weight", "0"]).kl)
    assert off.value == 0.0 and off.update(5.0) == 0.0


def test_dual_kl_with_an_empty_term_is_finite():
    total = dual_kl(torch.zeros(0), torch.tensor([0.2, 0.4]), beta_pos=1.0, beta_vel=0.5)
    assert total.item() == pytest.approx(0.15)


@pytest.mark.parametrize("direction", ["paper", "classic"])
def test_controller_reaches_lambda_max_at_the_last_warmup_update_whatever_the_kl(direction):
    c = AdaptiveKLController(init=1e-7, lambda_min=1e-7, lambda_max=1e-5, target=1e-5, warmup_updates=5,
                             history=2, direction=direction)
    seen = [c.update(1.0) for _ in range(5)]  # KL 1e5 x target: the feedback rule must not act during warm-up
    assert seen[-1] == 1e-5 and seen == pytest.approx([1e-7 + (1e-5 - 1e-7) * k / 5 for k in range(1, 6)])
    after = c.update(1.0)  # the first feedback update
    assert after == pytest.approx(1e-5 * 0.9 if direction == "paper" else 1e-5)  # classic: 1.1 x, clipped


@pytest.mark.parametrize("direction,above,below", [("paper", 0.9, 1.1), ("classic", 1.1, 0.9)])
def test_controller_dead_band_edges(direction, above, below):
    target, v0 = 2e-3, 1e-6

    def after(kl):
        c = AdaptiveKLController(init=v0, lambda_min=1e-8, lambda_max=1e-4, target=target, warmup_updates=0,
                                 history=1, direction=direction)
        return c.update(kl)

    for kl in (0.51 * target, 0.8 * target, 1.2 * target, 1.49 * target):  # inside [0.5, 1.5] target, off-centre
        assert after(kl) == v0, kl
    assert after(1.51 * target) == pytest.approx(v0 * above)
    assert after(0.49 * target) == pytest.approx(v0 * below)


def test_controller_does_not_record_an_infinite_kl():
    c = AdaptiveKLController(init=1e-6, warmup_updates=0, history=3, target=1e-3)
    c.update(1e-3)
    for bad in (float("inf"), float("-inf"), float("nan")):
        v = c.value
        c.update(bad)
        assert c.kl_mean == 1e-3 and c.value == v and c.state_dict()["kl_history"] == [1e-3]
    assert c.num_updates == 4


@pytest.mark.parametrize("init,expected", [(1e-3, 1e-5), (1e-9, 1e-7)])
def test_controller_start_outside_the_bounds_without_warmup_is_clipped(init, expected):
    c = AdaptiveKLController(init=init, lambda_min=1e-7, lambda_max=1e-5, target=1e-5, warmup_updates=0)
    assert c.value == expected


def test_flow_grpo_kl_pos_is_one_over_delta_times_the_authors():
    """docs/algorithm.md "What we do differently": the authors' KL divides the squared mean gap by 2 eta^2 sigma /
    (1 - sigma') + 1e-12 (their flow_grpo std_dev_t, without the step size); ours by 2 (V_t + 1e-6) with the true
    V_t. At T = 20, shift 5, eta = 0.5 ours is 96x theirs at step 0, 33.6x at step 10 and 4.8x at step 19."""
    from sage_grpo.schedule import sigma_schedule
    from sage_grpo.sde import step_variance

    eta, s = 0.5, sigma_schedule(20, 5.0)
    sigma, nxt = s[:-1], s[1:]
    var = step_variance("flow_grpo", sigma, nxt, eta, sigma_max=s[1])  # [20]
    gap = torch.full((20, 4), 0.01)  # the same mean gap at every step
    ours = kl_position(gap, torch.zeros_like(gap), var)
    theirs_std_sq = eta**2 * sigma / (1 - torch.where(sigma == 1, s[1], sigma))  # transcribed
    theirs = (gap.double() ** 2).mean(dim=1) / (2 * theirs_std_sq + 1e-12)
    ratio = (ours.double() / theirs)[[0, 10, 19]]
    torch.testing.assert_close(ratio, torch.tensor([96.0, 33.6, 4.8], dtype=torch.float64), rtol=2e-4, atol=0)
    torch.testing.assert_close(ours.double() / theirs, 1 / (sigma - nxt), rtol=2e-4, atol=0)  # 1 / delta throughout


class _AuthorsController:
    """The authors' adaptive coefficient, transcribed (per call; their calls are micro-steps, ours updates): the
    value starts at kl_coef; each call counts step_count += 1 and, while step_count < warm-up, sets
    min + (max - min) * step_count / warm-up; from step_count = warm-up on, the paper's x0.9 / x1.1 on the mean of
    the last H KL values, clipped to [min, max]."""

    def __init__(self, kl_coef=1e-7, kl_min=1e-7, kl_max=1e-5, target=1e-5, warmup=100, history=10):
        self.value, self.min, self.max, self.target, self.warmup = kl_coef, kl_min, kl_max, target, warmup
        self.kls: list[float] = []
        self.history, self.step_count = history, 0

    def update(self, kl: float) -> float:
        self.kls = (self.kls + [kl])[-self.history:]
        self.step_count += 1
        if self.step_count < self.warmup:
            self.value = self.min + (self.max - self.min) * self.step_count / self.warmup
            return self.value
        d = sum(self.kls) / len(self.kls)
        if d > 1.5 * self.target:
            self.value *= 0.9
        elif d < 0.5 * self.target:
            self.value *= 1.1
        self.value = min(max(self.value, self.min), self.max)
        return self.value


def test_the_warm_up_against_the_authors():
    """docs/algorithm.md "What we do differently": the authors' warm-up ends at step_count < 100, so with a KL in
    the band their coefficient settles at min + 0.99 (max - min), 1 % below ours (max, as the paper's Eq. 41);
    with a KL far above target their decay starts one update earlier and stays 12 % below ours; and their warm-up
    ramps from kl_min_coef (kl_coef is the value before the first update only), ours from kl_coef."""
    def run(kl: float, n: int, **kw) -> tuple[list[float], list[float]]:
        ours = AdaptiveKLController(init=kw.get("kl_coef", 1e-7), lambda_min=1e-7, lambda_max=1e-5, target=1e-5,
                                    warmup_updates=100, history=10)
        theirs = _AuthorsController(**kw)
        return [ours.update(kl) for _ in range(n)], [theirs.update(kl) for _ in range(n)]

    ours, theirs = run(1e-5, 150)  # in the band: no adaptation after the warm-up
    assert ours[:99] == pytest.approx(theirs[:99], rel=1e-12)  # the same ramp until update 99
    assert ours[-1] == pytest.approx(1e-5, rel=1e-12)
    assert theirs[-1] == pytest.approx(1e-7 + 0.99 * (1e-5 - 1e-7), rel=1e-12)
    assert theirs[-1] / ours[-1] == pytest.approx(0.99, abs=1e-4)  # 1 % low
    ours, theirs = run(1e-3, 102)  # far above target: the paper's direction lowers the coefficient
    assert ours[99] == pytest.approx(1e-5, rel=1e-12) and theirs[99] == pytest.approx(0.9 * theirs[98], rel=1e-12)
    for k in (99, 100, 101):
        assert ours[k] / theirs[k] == pytest.approx(1.122, abs=1e-3), k  # 12 % apart from update 100 on
    ours, theirs = run(1e-5, 1, kl_coef=5e-6)
    assert ours[0] == pytest.approx(5e-6 + (1e-5 - 5e-6) / 100, rel=1e-12)  # our ramp starts at kl_coef
    assert theirs[0] == pytest.approx(1e-7 + (1e-5 - 1e-7) / 100, rel=1e-12)  # theirs at kl_min_coef
