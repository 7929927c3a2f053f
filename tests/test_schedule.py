import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from sage_grpo.schedule import num_train_timesteps, select_timesteps, sigma_schedule, timesteps_from_sigmas

# sigma_i = s u_i / (1 + (s - 1) u_i), u_i = 1 - i/T (README "The samplers"), T = 20, shift 5, to 4 decimals
PAPER_SIGMAS = [1.0, .9896, .9783, .9659, .9524, .9375, .9211, .9028, .8824, .8594, .8333, .8036, .7692,
                .7292, .6818, .625, .5556, .4688, .3571, .2083, 0.0]


def test_schedule_matches_algorithm_table():
    s = sigma_schedule(20, 5.0)
    assert s.shape == (21,)
    torch.testing.assert_close(s, torch.tensor(PAPER_SIGMAS, dtype=torch.float64), atol=6e-5, rtol=0)


@pytest.mark.parametrize("steps,shift", [(20, 5.0), (40, 5.0), (8, 1.0), (13, 7.0)])
def test_schedule_matches_diffusers_scheduler(steps, shift):
    # The HunyuanVideo-1.5 pipeline passes sigmas = linspace(1, 0, T + 1)[:-1] to the shifted scheduler.
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    ours = sigma_schedule(steps, shift)
    torch.testing.assert_close(ours.float(), sched.sigmas.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(timesteps_from_sigmas(ours[:-1]).float(), sched.timesteps.float(), atol=1e-3, rtol=0)


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_steps"):
        sigma_schedule(0)
    with pytest.raises(ValueError, match="shift"):
        sigma_schedule(10, 0.0)


@pytest.mark.parametrize("frac,expected", [(1.0, 20), (0.5, 10), (0.3, 6), (0.33, 6), (0.05, 1), (0.51, 10),
                                           (0.99, 19)])
def test_num_train_timesteps_is_the_authors_int(frac, expected):
    assert num_train_timesteps(20, frac) == expected == int(round(20 * frac, 9))


def test_num_train_timesteps_float_noise_and_zero():
    # 0.29 * 100 = 28.999999999999996 must not lose a step; 25 * 0.28 = 7.000000000000001 stays 7
    assert 0.29 * 100 < 29 and 25 * 0.28 > 7
    assert num_train_timesteps(100, 0.29) == 29 and num_train_timesteps(25, 0.28) == 7
    with pytest.raises(ValueError, match="trains no step"):
        num_train_timesteps(20, 0.04)


def test_select_timesteps_identity_and_permutation():
    assert select_timesteps(10, 0.5, permute=False).tolist() == [0, 1, 2, 3, 4]
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a, b = select_timesteps(10, 1.0, True, g1), select_timesteps(10, 1.0, True, g2)
    assert a.tolist() == b.tolist() and sorted(a.tolist()) == list(range(10))
    assert a.tolist() != list(range(10))
    part = select_timesteps(10, 0.3, True, torch.Generator().manual_seed(0))
    assert len(part) == 3 and len(set(part.tolist())) == 3
    with pytest.raises(ValueError, match="timestep_fraction"):
        select_timesteps(10, 0.0)
