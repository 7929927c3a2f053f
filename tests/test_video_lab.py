"""The video lab (scripts/video_ablation.py, sage_grpo/lab/video.py): its pure pieces, its user errors, and (slow) its
machinery end to end on a tiny grid against the tiny random model."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from sage_grpo.errors import SageGRPOError
from sage_grpo.lab.video import (
    aggregate_runs,
    cell_flags,
    curve_gain,
    format_video_table,
    reward_curve,
    run_row,
)
from sage_grpo.recipes import RECIPES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "video_ablation.py"
CONFIG = ROOT / "configs" / "tiny_world.yaml"


def _load_script():
    spec = importlib.util.spec_from_file_location("video_ablation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------------ cell flags


@pytest.mark.parametrize("sampler", ["dance_grpo", "flow_grpo", "sage_grpo", "cps"])
@pytest.mark.parametrize("kl", ["none", "dual"])
@pytest.mark.parametrize("eq", [False, True])
def test_cell_flags_are_real_post_train_flags_with_the_cell_values(sampler, kl, eq):
    from sage_grpo.config import load_config

    cfg = load_config(["--config", str(CONFIG), *cell_flags(sampler, kl, eq, kl_weight=1e-5)])
    assert cfg.rollout.sde_type == sampler
    assert cfg.optim.use_grad_balancing is eq
    if kl == "none":
        assert cfg.kl.kl_weight == 0  # no KL term, no anchor
    else:
        assert cfg.kl.kl_weight > 0 and cfg.kl.use_dual_kl and cfg.kl.use_moving_KL


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_flags_are_real_post_train_flags_with_the_recipe_values(recipe):
    from sage_grpo.config import load_config
    from sage_grpo.recipes import recipe_flags, recipe_settings

    cfg = load_config(["--config", str(CONFIG), *recipe_flags(recipe, 10)])
    for key, value in recipe_settings(recipe, 10).items():
        group = cfg.rollout if hasattr(cfg.rollout, key) else cfg.optim
        assert getattr(group, key) == value, key
    assert (cfg.rollout.cfg_scale == 1.0) == (recipe.startswith("cfg_free") or recipe == "flash")
    # the config trains an SDE window from one noise per group; a recipe replaces both, so "paper" is the paper's
    # every-step SDE from independent noise on any config
    base = load_config(["--config", str(CONFIG)]).rollout
    assert (base.sde_window_size, base.use_same_noise) == (5, True)
    if recipe in ("paper", "cfg_free"):
        assert (cfg.rollout.sde_window_start, cfg.rollout.sde_window_size, cfg.rollout.use_same_noise) == (0, 0, False)


def test_flop_table_gives_phases_and_forwards_against_the_paper_and_standard_errors():
    from sage_grpo.lab.report import aggregate
    from sage_grpo.lab.video import format_flop_table

    rows = [{"recipe": r, "seed": s, "steps": 20, "forwards_per_step": f, "gflop_rollout": f / 10,
             "gflop_anchor": 1.0, "gflop_update": f / 5, "gflop_step": f / 10 + 1.0 + f / 5, "reward_gain": g,
             "rollout_gain": 0.0, "heldout_change": 0.0, "drift": 0.0}
            for r, f, gains in (("paper", 60.0, (0.1, 0.3, 0.2)), ("sliding", 30.0, (0.0, 0.4, 0.2)))
            for s, g in enumerate(gains)]
    table = format_flop_table(aggregate(rows, keys=("recipe", "steps")), ["paper", "sliding"], {"sliding": 0.4})
    line = next(x for x in table.splitlines() if x.startswith("| sliding |"))
    # FLOPs 3 + 1 + 6 = 10 against the paper's 19; gain mean 0.2, sample std 0.2, standard error 0.2 / sqrt(3)
    assert line.startswith(f"| sliding | 20 | 3.00 / 1.00 / 6.00 | 10.00 | {10 / 19:.2f} | 0.40 | 30.00 | 3 | "
                           "0.200 ± 0.115 |"), line


def test_cell_flags_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="kl_weight > 0"):
        cell_flags("sage_grpo", "dual", True, kl_weight=0.0)  # "dual" with no KL term would be "none" in disguise
    with pytest.raises(ValueError, match="unknown KL"):
        cell_flags("sage_grpo", "fixed", True, kl_weight=1e-5)
    with pytest.raises(ValueError, match="unknown sampler"):
        cell_flags("ode", "none", True, kl_weight=1e-5)


# ------------------------------------------------------------------------------------------------ rows, table


def test_curve_gain_is_last_quarter_minus_first_quarter():
    assert curve_gain([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0]) == pytest.approx(3.0 - 0.0)
    assert curve_gain([0.5]) == 0.0
    assert curve_gain([0.1, 0.4]) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        curve_gain([])


def test_reward_curve_reads_steps_with_a_reward(tmp_path):
    rows = [{"step": 1, "reward/total_mean": 0.25}, {"step": 2, "reward/total_mean": None},
            {"step": 3, "perf/step_s": 1.0}, {"step": 4, "reward/total_mean": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert reward_curve(tmp_path / "metrics.jsonl") == [(1, 0.25), (4, 0.5)]


def _metrics(shift: float) -> dict[str, torch.Tensor]:
    keys = ("shape_fidelity", "background_cleanliness", "temporal_consistency", "object_persistence",
            "caption_agreement")
    return {k: torch.tensor([0.5, 0.7]) + shift for k in keys}


def test_run_row_pairs_gains_with_the_base_and_names_drift():
    metrics = {**_metrics(-0.1), "reference_distance": torch.tensor([0.1, 0.3])}
    row = run_row({"sampler": "cps", "seed": 3}, reward=torch.tensor([0.8, 0.6]), base_reward=torch.tensor([0.5, 0.5]),
                  metrics=metrics, base_metrics=_metrics(0.0), curve=[(1, 0.2), (2, 0.3), (3, 0.4), (4, 0.6)])
    assert row["sampler"] == "cps" and row["seed"] == 3
    assert row["reward"] == pytest.approx(0.7) and row["base_reward"] == pytest.approx(0.5)
    assert row["reward_gain"] == pytest.approx(0.2)
    assert row["drift"] == pytest.approx(0.2)
    assert "reference_distance" not in row and "base_drift" not in row
    assert row["shape_fidelity"] == pytest.approx(0.5) and row["base_shape_fidelity"] == pytest.approx(0.6)
    assert row["heldout_change"] == pytest.approx(-0.1)
    assert (row["rollout_first"], row["rollout_last"], row["rollout_gain"]) == pytest.approx((0.2, 0.6, 0.4))


def _row(sampler, eq, kl, seed, gain):
    metrics = {**_metrics(0.0), "reference_distance": torch.tensor([0.01 * (seed + 1)] * 2)}
    return run_row({"sampler": sampler, "equalizer": eq, "kl": kl, "seed": seed, "steps": 4},
                   reward=torch.tensor([0.5 + gain] * 2), base_reward=torch.tensor([0.5] * 2), metrics=metrics,
                   base_metrics=_metrics(0.0), curve=[(1, 0.1), (2, 0.1 + gain)])


def test_table_is_mean_and_standard_error_over_seeds_in_grid_order():
    rows = [_row("sage_grpo", True, "dual", s, g) for s, g in ((0, 0.1), (1, 0.3))]
    rows += [_row("flow_grpo", False, "none", 0, 0.2), _row("sage_grpo", False, "none", 0, -0.1)]
    aggs = aggregate_runs(rows)
    cell = next(a for a in aggs if (a["sampler"], a["equalizer"], a["kl"]) == ("sage_grpo", True, "dual"))
    assert cell["n"] == 2
    assert cell["reward_gain_mean"] == pytest.approx(0.2)
    assert cell["reward_gain_std"] == pytest.approx(math.sqrt(0.02))  # sample std of 0.1, 0.3
    assert cell["drift_mean"] == pytest.approx(0.015)
    table = format_video_table(aggs, ["flow_grpo", "sage_grpo", "cps"], ["none", "dual"]).splitlines()
    assert table[0].startswith("| Method | Equalizer | KL | Seeds | Reward | Reward gain |")
    assert table[2].startswith("| Base model | - | - | 2 | 0.500 ± 0.000 | - |")
    assert [line.split(" | ")[:4] for line in table[3:]] == [
        ["| flow_grpo", "off", "none", "1"], ["| sage_grpo", "off", "none", "1"], ["| sage_grpo", "on", "dual", "2"]]
    assert "| 0.200 ± 0.100 |" in table[5]  # sample std 0.141 over 2 seeds / sqrt(2)
    assert table[3].startswith("| flow_grpo | off | none | 1 | 0.700 | 0.200 |")  # one seed: no spread, no ±
    assert format_video_table([], ["sage_grpo"], ["none"]) == ""


# ------------------------------------------------------------------------------------------------ the script


def test_quick_defaults_and_subsets():
    mod = _load_script()
    a = mod.parse_args(["--quick"])
    assert (a.seeds, a.steps, a.samplers, a.kls, a.equalizer) == (
        1, mod.QUICK_STEPS, ["dance_grpo", "flow_grpo", "sage_grpo", "cps"], ["none", "dual"], [False, True])
    a = mod.parse_args(["--samplers", "cps", "cps", "--equalizer", "on"])
    assert (a.seeds, a.steps, a.samplers, a.equalizer) == (3, None, ["cps"], [True])  # None: the config's max_steps


@pytest.mark.parametrize("argv, message", [
    (["--samplers", "grpo"], "invalid choice: 'grpo'"),
    (["--kls", "fixed"], "invalid choice: 'fixed'"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_flags_are_one_error(argv, message):
    with pytest.raises(SageGRPOError, match=message):
        _load_script().parse_args(argv)


def test_missing_model_or_config_is_one_error_before_anything_loads(tmp_path):
    mod = _load_script()
    with pytest.raises(SageGRPOError, match="no HunyuanVideo-1.5 checkpoint found"):
        mod.main(["--quick", "--model_path", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")])
    with pytest.raises(SageGRPOError, match="is not a file"):
        mod.main(["--quick", "--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "out")])


def _small_config(tmp_path: Path, **changes) -> Path:
    """configs/tiny_world.yaml at test size: 4 training captions, 2 SDE steps (the config's SDE window of 5 steps
    cut to the first), 5 frames, 2 held-out captions, 2 videos per step."""
    cfg = yaml.safe_load(CONFIG.read_text())
    train = tmp_path / "train.txt"
    train.write_text("\n".join((ROOT / cfg["data"]["train_video_csv"]).read_text().splitlines()[:4]) + "\n")
    cfg["data"].update(train_video_csv=str(train), batch_size=2, num_generations=2)
    cfg["rollout"].update(grpo_sampling_steps=2, sample_n_frames=5, sde_window_start=0, sde_window_size=1)
    heldout = (ROOT / cfg["validation"]["valid_video_csv"]).read_text().splitlines()[:2]
    cfg["validation"].update(valid_video_csv="", validation_prompts=heldout, validate_video_length=5,
                             validation_num_inference_steps=2)
    for group, values in changes.items():
        cfg[group].update(values)
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dual_needs_a_kl_weight_in_the_config(tmp_path, tiny_model):
    config = _small_config(tmp_path, kl={"kl_weight": 0.0})
    with pytest.raises(SageGRPOError, match="KL 'dual' needs kl_weight > 0"):
        _load_script().main(["--config", str(config), "--model_path", str(tiny_model), "--out", str(tmp_path / "o")])


@pytest.mark.slow
def test_quick_machinery_runs_end_to_end(tmp_path, tiny_model, capsys):
    mod = _load_script()
    out = tmp_path / "lab"
    argv = ["--quick", "--steps", "2", "--samplers", "sage_grpo", "flow_grpo", "--equalizer", "on", "--config",
            str(_small_config(tmp_path)), "--model_path", str(tiny_model), "--out", str(out), "--threads", "1"]
    assert mod.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| Base model |" in printed and "| flow_grpo | on | dual |" in printed

    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [(r["sampler"], r["equalizer"], r["kl"], r["seed"]) for r in rows] == [
        ("sage_grpo", "True", "none", "0"), ("sage_grpo", "True", "dual", "0"),
        ("flow_grpo", "True", "none", "0"), ("flow_grpo", "True", "dual", "0")]
    for r in rows:
        for k in ("reward", "reward_gain", "rollout_gain", "drift", "heldout_change", "shape_fidelity",
                  "background_cleanliness", "temporal_consistency", "caption_agreement", "train_s", "eval_s"):
            assert math.isfinite(float(r[k])), (k, r[k])
        assert float(r["drift"]) > 0  # two GRPO updates moved the weights, so the samples moved
    curves = list(csv.DictReader((out / "curves.csv").open()))
    assert len(curves) == 4 * 2  # runs x steps
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 2 + 1 + 4  # header, rule, base, cells
    assert all("nan" not in line for line in table)
    assert (out / "stability_plasticity.png").stat().st_size > 0 and (out / "reward_curves.png").is_file()
    assert sorted(p.name for p in (out / "base").iterdir()) == ["base_s0.pt"]
    assert not list((out / "runs").glob("*/checkpoint-*"))  # evaluated checkpoints are deleted
    assert all((out / "runs" / n / "metrics.jsonl").is_file() for n in (
        "sage_grpo_eqon_klnone_s0", "flow_grpo_eqon_kldual_s0"))


@pytest.mark.slow
def test_recipes_run_end_to_end_with_their_forward_counts(tmp_path, tiny_model, capsys):
    """--recipes: each recipe a post_train.py run; its row carries the forwards its own configuration needs (the
    step benchmark checks those against the counted ones) and the table compares them with the paper's."""
    from sage_grpo.config import load_config
    from sage_grpo.recipes import minimum_forwards, recipe_flags

    mod = _load_script()
    out = tmp_path / "lab"
    config = _small_config(tmp_path, rollout={"grpo_sampling_steps": 4})  # a window of 1 sliding over steps 1..3
    argv = ["--recipes", "paper", "cfg_free_sliding", "flash", "--seeds", "1", "--steps", "2", "--eval_every", "1",
            "--config", str(config), "--model_path", str(tiny_model), "--out", str(out), "--threads", "1"]
    assert mod.main(argv) == 0
    every = list(csv.DictReader((out / "summary.csv").open()))
    assert sorted((r["recipe"], r["steps"]) for r in every) == [(n, s) for n in ("cfg_free_sliding", "flash", "paper")
                                                                 for s in ("1", "2")]  # every checkpoint evaluated
    rows = {r["recipe"]: r for r in every if r["steps"] == "2"}
    for name, r in rows.items():  # the FLOPs are the loop's own meter's, per sample and step
        metered = [json.loads(x) for x in (out / "runs" / f"{name}_s0" / "metrics.jsonl").read_text().splitlines()]
        step = sum(m["perf/step_tflop"] for m in metered if "perf/step_tflop" in m) / 2 * 1e3 / 2
        assert float(r["gflop_step"]) == pytest.approx(step)
    assert float(rows["flash"]["gflop_update"]) < float(rows["paper"]["gflop_update"]) / 2
    text = (out / "recipes.md").read_text()
    assert "At equal drift" in text and "| flash |" in text and (out / "equal_drift.png").is_file()
    mod.run_cell = lambda *a, **k: pytest.fail("a run evaluated before ran again")
    assert mod.main(argv) == 0  # the second call reads every run's result.json
    # --report_only: the tables of what --out holds; without the paper's runs no equal-drift table, without any run
    # one line
    only = [a for a in argv if a != "paper"] + ["--report_only"]
    assert mod.main(only) == 0 and "At equal drift" not in (out / "recipes.md").read_text()
    with pytest.raises(SageGRPOError, match="holds no finished run"):
        mod.main([a if a != str(out) else str(tmp_path / "empty") for a in argv] + ["--report_only"])
    del rows["flash"]
    for name, r in rows.items():
        cfg = load_config(["--config", str(config), *recipe_flags(name, load_config(
            ["--config", str(config)]).rollout.grpo_sampling_steps)])
        work = minimum_forwards(cfg, 2)
        expect = sum(w["rollout"] + w["anchor"] + w["update"] for w in work) / (2 * cfg.data.batch_size)
        assert float(r["forwards_per_step"]) == pytest.approx(expect) and math.isfinite(float(r["reward_gain"]))
    assert float(rows["cfg_free_sliding"]["forwards_per_step"]) < float(rows["paper"]["forwards_per_step"]) / 2
    assert "| cfg_free_sliding |" in (out / "recipes.md").read_text()


def test_step_flops_reads_the_meters_phases_per_sample_up_to_a_step(tmp_path):
    mod = _load_script()
    f = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "perf/rollout_tflop": 0.002 * s, "perf/anchor_tflop": 0.0, "perf/update_tflop": 0.006,
             "perf/step_tflop": 0.002 * s + 0.006} for s in (1, 2, 3)]
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n{\"step\": 3, \"reward/total_mean\": 1.0}\n")
    got = mod.step_flops(f, 2, batch_size=4)
    # steps 1 and 2: rollout (2 + 4) / 2 GFLOP per step, / 4 samples
    assert got["gflop_rollout"] == pytest.approx(3.0 / 4) and got["gflop_update"] == pytest.approx(6.0 / 4)
    assert got["gflop_step"] == pytest.approx(got["gflop_rollout"] + got["gflop_update"])
    with pytest.raises(SageGRPOError, match="no perf/step_tflop"):
        mod.step_flops(f, 0, batch_size=4)


def test_a_run_evaluated_before_covers_the_same_settings_and_fewer_steps(tmp_path):
    """read_result: the same resolved settings (flags in another order, another --output_dir) and at least the
    steps asked for -> the rows up to them; other settings or too few steps -> None (the run is done again)."""
    mod = _load_script()
    args = mod.parse_args(["--recipes", "paper", "--steps", "4", "--eval_every", "2", "--out", str(tmp_path)])
    run = tmp_path / "runs" / "paper_s0"
    run.mkdir(parents=True)
    from sage_grpo.recipes import recipe_flags

    argv = mod.run_argv(args, run, recipe_flags("paper", 10), 0)
    rows = [{"recipe": "paper", "seed": 0, "steps": s, "drift": 0.1 * s} for s in (2, 4)]
    mod.write_result(run, argv, rows, [{"recipe": "paper", "seed": 0, "step": s, "reward": 0.1} for s in (1, 2, 3, 4)])
    flipped = mod.run_argv(args, tmp_path / "elsewhere", [x for pair in reversed(list(zip(
        recipe_flags("paper", 10)[::2], recipe_flags("paper", 10)[1::2]))) for x in pair], 0)
    got = mod.read_result(run, flipped, 2)
    assert [r["steps"] for r in got["rows"]] == [2] and [c["step"] for c in got["curves"]] == [1, 2]
    assert mod.read_result(run, argv, 4)["rows"] == rows
    assert mod.read_result(run, argv, 3) is None  # no evaluated step 3
    assert mod.read_result(run, mod.run_argv(args, run, recipe_flags("cfg_free", 10), 0), 4) is None
    assert mod.read_result(run, argv + ["--learning_rate", "1e-3"], 4) is None
