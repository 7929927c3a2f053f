"""The named recipes (sage_grpo.recipes): --recipe layering, their real-size FLOPs, the forwards of the ODE tail's
solver steps, and Flash-GRPO's one timestep per group."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sage_grpo.config import dump_yaml, load_config
from sage_grpo.errors import SageGRPOError
from sage_grpo.recipes import (
    ODE_TAIL_STEPS,
    RECIPE_FLOP_RATIOS,
    RECIPES,
    minimum_forwards,
    real_size_flop_ratios,
    recipe_settings,
    step_flops,
)

ROOT = Path(__file__).resolve().parents[1]
WORLD = str(ROOT / "configs/tiny_world.yaml")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_sets_its_keys_over_the_yaml_and_under_explicit_flags(name):
    cfg = load_config(["--config", WORLD, "--recipe", name])
    for key, value in recipe_settings(name, 10).items():
        group = next(g for g in ("rollout", "optim") if hasattr(getattr(cfg, g), key))
        assert getattr(getattr(cfg, group), key) == value, key
    assert cfg.rollout.recipe == name
    assert f"recipe: {name}" in dump_yaml(cfg)  # recorded in config.yaml
    # an explicit flag wins over the recipe's key, whatever the order on the command line
    on_top = load_config(["--config", WORLD, "--sde_window_size", "3", "--recipe", name])
    assert on_top.rollout.sde_window_size == 3
    assert "sde_window_size" in on_top.command_line and "use_same_noise" in on_top.command_line


def test_a_recipe_in_the_yaml_lies_under_the_files_own_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  recipe: cfg_free_sliding\n  cfg_scale: 3.0\n  grpo_sampling_steps: 12\n")
    cfg = load_config(["--config", str(f)])
    assert cfg.rollout.cfg_scale == 3.0  # the file's key over its recipe's
    assert cfg.rollout.sde_window_size == 3  # the recipe's window is T / 4 of the file's T 12
    assert "shared_prefix" in cfg.explicit and "shared_prefix" not in cfg.command_line
    assert load_config(["--config", str(f), "--recipe", "paper"]).rollout.cfg_scale == 3.0  # paper keeps CFG


def test_an_unknown_recipe_is_one_error_naming_the_recipes():
    with pytest.raises(SageGRPOError, match="recipe") as e:
        load_config(["--recipe", "fastest"])
    assert "flash" in str(e.value)


def test_flash_trains_one_step_of_the_window_per_group_and_the_solver_tail():
    s = recipe_settings("flash", 20)
    assert s["sde_window_size"] == 5 and math.floor(round(5 * s["timestep_fraction"], 9)) == 1
    assert s["group_timesteps"] and s["cfg_scale"] == 1.0
    assert (s["ode_solver"], s["ode_steps"]) == ("unipc", ODE_TAIL_STEPS)
    assert recipe_settings("paper", 20)["ode_steps"] == 0  # every recipe sets the solver keys


def test_the_wide_recipe_explores_two_fifths_of_the_schedule_under_a_quarter_of_the_flops():
    wide, narrow = recipe_settings("cfg_free_wide_unipc", 10), recipe_settings("cfg_free_sliding_unipc", 10)
    assert (wide["sde_window_size"], narrow["sde_window_size"]) == (4, 2)
    assert recipe_settings("cfg_free_wide_unipc", 20)["sde_window_size"] == 8
    assert {k: v for k, v in wide.items() if k != "sde_window_size"} == {
        k: v for k, v in narrow.items() if k != "sde_window_size"}
    assert RECIPE_FLOP_RATIOS["cfg_free_sliding_unipc"] < RECIPE_FLOP_RATIOS["cfg_free_wide_unipc"] < 0.25


def test_the_help_lists_the_real_size_flop_ratios_the_model_gives():
    """RECIPE_FLOP_RATIOS (shown by --help) are sage_grpo.flops' model FLOPs per step at 81x352x624 on the
    defaults, and they are what an independent sum over the phases gives for the paper's and cfg_free's recipes."""
    from sage_grpo.config import Config

    ratios = real_size_flop_ratios(Config())
    assert ratios == pytest.approx(RECIPE_FLOP_RATIOS, abs=5e-4)
    assert ratios["cfg_free"] == pytest.approx(0.5)  # one forward instead of a CFG pair, in every phase
    assert ratios["flash"] < 0.25  # the target's budget
    from sage_grpo.config import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "flash 0.08x" in help_text and "cfg_free_sliding 0.18x" in help_text


def test_step_flops_is_the_sum_of_forwards_times_a_forward():
    """The paper's recipe at the defaults: T 20 steps of 2 samples x CFG pair in the rollout; every step trained,
    forward + backward (full fine-tuning: backward = 2 forwards, sage_grpo.flops); the anchor's forwards."""
    from sage_grpo.config import Config
    from sage_grpo.flops import TransformerShape, transformer_flops

    cfg = Config()
    shape = TransformerShape()
    fwd = transformer_flops(shape.video_tokens(21, 22, 39), [256], shape).model
    got = step_flops(cfg, 4)
    work = minimum_forwards(cfg, 4)
    assert got["rollout"] == pytest.approx(20 * 2 * 2 * fwd)
    assert got["update"] == pytest.approx(20 * 2 * 2 * 3 * fwd)
    assert got["anchor"] == pytest.approx(sum(w["anchor"] for w in work) / 4 * fwd)
    assert got["step"] == pytest.approx(got["rollout"] + got["update"] + got["anchor"])


def test_the_solver_tail_counts_its_own_steps():
    """minimum_forwards with --ode_steps: a sample takes the window's steps and the tail's solver steps."""
    cfg = load_config(["--config", WORLD, "--recipe", "cfg_free_sliding_unipc", "--kl_weight", "0"])
    # T 10, window of 2 sliding from step 1 every 2 updates, shared prefix, 2 prompts x 4: at update 0 the window
    # is [1, 3): prefix 1 step once per prompt, 2 window steps and 4 tail steps a sample (the schedule's tail has 7)
    first = minimum_forwards(cfg, 1)[0]
    assert first["rollout"] == 1 * 2 + (2 + ODE_TAIL_STEPS) * 8
    euler = load_config(["--config", WORLD, "--recipe", "cfg_free_sliding", "--kl_weight", "0"])
    assert minimum_forwards(euler, 1)[0]["rollout"] == 1 * 2 + (2 + 7) * 8


def test_solver_flags_without_a_tail_are_one_error():
    with pytest.raises(SageGRPOError, match="after the SDE window"):
        load_config(["--config", WORLD, "--sde_window_size", "0", "--ode_solver", "unipc"])
    with pytest.raises(SageGRPOError, match="--ode_steps must be >= 0"):
        load_config(["--config", WORLD, "--ode_steps", "-1"])


def test_one_timestep_per_group_on_any_number_of_ranks():
    """plan_generators with the group size: the G samples of a group draw the same steps, groups differ, and a group
    that spans two ranks draws the same steps on both; without it every sample draws its own."""
    from sage_grpo.grpo import plan_generators, plan_steps

    var = torch.ones(10)

    def plan(first, b, g):
        return plan_steps(b, var, 0.2, True, plan_generators(5, 3, first, b, g))

    one = plan(0, 8, 4)  # [8, 2]: two groups of 4 on one rank
    assert all(torch.equal(one[i], one[0]) for i in range(4)) and all(torch.equal(one[i], one[4]) for i in range(4, 8))
    assert not torch.equal(one[0], one[4])
    two = torch.cat([plan(0, 2, 4), plan(2, 2, 4), plan(4, 2, 4), plan(6, 2, 4)])  # 4 ranks of 2: groups span two
    assert torch.equal(one, two)
    own = plan(0, 8, 1)
    assert len({tuple(r.tolist()) for r in own}) > 2  # each sample its own steps
    assert torch.equal(own[0], plan(0, 8, 4)[0])  # group 0's seed is video 0's: the first sample keeps its steps


@pytest.mark.parametrize("grouped", [True, False])
def test_post_train_plans_one_timestep_per_group_with_the_flag(grouped):
    """post_train.plan_round (the loop's own planning) on rank 1 of 2 with --group_timesteps: the config's flag reaches
    the plan, and the rank's groups draw what one rank holding the whole batch draws for them."""
    from types import SimpleNamespace

    import post_train
    from sage_grpo.window import window_mask

    cfg = load_config(["--config", WORLD, "--recipe", "flash", "--group_timesteps", str(grouped),
                       "--timestep_fraction", "0.5", "--sde_window_stride", "0", "--sde_window_size", "4"])
    windows = window_mask(10, 1, 5).unsqueeze(0)  # [1, T]
    traj = SimpleNamespace(batch_size=4, sde_steps=windows[0])

    def plan(rank, b):
        c = SimpleNamespace(cfg=cfg, info=SimpleNamespace(dp_rank=rank), variance=torch.ones(10), windows=windows)
        return post_train.plan_round(c, SimpleNamespace(step=3), SimpleNamespace(**{**vars(traj), "batch_size": b}))

    whole, second = plan(0, 8), plan(1, 4)  # [8, 2], [4, 2]: videos 4..7 = the second group
    assert torch.equal(second, whole[4:])
    same = all(torch.equal(r, second[0]) for r in second)
    assert same == grouped
