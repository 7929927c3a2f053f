import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sage_grpo.config import (
    FIELDS,
    GROUPS,
    Config,
    build_parser,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    parse_bool,
    parse_size,
    resume_settings,
    validate,
)
from sage_grpo.errors import SageGRPOError

ROOT = Path(__file__).resolve().parents[1]

# The authors' flags and defaults, transcribed from reference_system.md (an independent source of truth).
AUTHORS_DEFAULTS = {
    "pretrained_model_root": "ckpts", "pretrained_transformer_version": "480p_t2v", "learning_rate": 1e-5,
    "weight_decay": 0.01, "max_steps": 10000, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0,
    "use_muon": True, "dtype": "bf16", "master_weight_type": "fp32", "seed": 42, "enable_fsdp": True,
    "enable_gradient_checkpointing": True, "dp_replicate": 1, "batch_size": 2, "num_generations": 4,
    "reward_model": "videoalign_local", "reward_weights": '{"VQ":0.5,"MQ":0.5,"TA":1.0}',
    "reward_checkpoint_mode": "v3", "sde_type": "sage_grpo", "use_grad_balancing": True,
    "enable_timestep_permutation": True, "kl_weight": 1e-5, "kl_coef": 1e-7, "kl_min_coef": 1e-7,
    "use_moving_KL": True, "update_ref_model_step": 10, "use_dual_kl": True, "dual_kl_moving_weight": 1.0,
    "dual_kl_step_weight": 0.1, "validation_interval": 100, "validate_at_step0": False, "validate_video_length": 81,
    "validation_timestep_shift": 5.0, "validation_fixed_size": "480x864", "output_dir": "./outputs",
    "save_interval": 100, "log_interval": 1, "use_lora": False, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
    # hidden settings exposed as flags
    "grpo_sampling_steps": 20, "sample_n_frames": 81, "height": 352, "width": 624, "eta": 0.5, "cfg_scale": 6.0,
    "neg_prompt": "", "flow_shift": 5.0, "clip_range": 1e-4, "adv_clip_max": 5.0, "timestep_fraction": 1.0,
    "mini_batch_size_per_update": 1, "kl_compute_mode": "rollout_phase", "use_same_noise": False, "video_fps": 24,
    "validation_num_inference_steps": 40, "validation_guidance_scale": 6.0, "validation_seed": 930,
}
OTHER_AUTHORS_FLAGS = ["warmup_steps", "sp_size", "num_workers", "train_video_csv", "reference_mode_offload",
                       "valid_video_csv", "validation_prompts", "resume_from_checkpoint", "lora_target_modules",
                       "pretrained_lora_path"]


def test_authors_flags_exist_with_their_defaults():
    flat = {k: v for group in config_to_dict(Config()).values() for k, v in group.items()}
    for name, default in AUTHORS_DEFAULTS.items():
        assert flat[name] == default, name
    for name in OTHER_AUTHORS_FLAGS:
        assert name in flat


def test_every_field_has_help_and_a_flag():
    help_text = build_parser().format_help()
    for name, (_, f, _) in FIELDS.items():
        assert f.metadata["help"], name
        assert f"--{name}" in help_text


def test_layering_defaults_yaml_cli(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  eta: 0.3\n  sde_type: flow_grpo\noptim:\n  learning_rate: 2.0e-6\n")
    cfg = load_config(["--config", str(p), "--eta", "0.7"])
    assert cfg.rollout.eta == 0.7  # CLI beats YAML
    assert cfg.rollout.sde_type == "flow_grpo"  # YAML beats default
    assert cfg.optim.learning_rate == 2e-6
    assert cfg.data.batch_size == 2  # default


def test_a_resume_takes_the_saved_runs_settings_and_the_command_lines_flags(tmp_path):
    """On a resume the saved run's config is the base: a flag given on the command line overrides it (reported), a
    setting not given keeps the run's value, the --config file's values do not override (the run took them at its
    start, under its flags) and are reported where they differ; where the run is and its layout come from this
    launch."""
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  sde_type: sage_grpo\n  eta: 0.3\noptim:\n  max_steps: 60\n")
    run = load_config(["--config", str(p), "--sde_type", "flow_grpo", "--max_steps", "3", "--lora_r", "4",
                       "--output_dir", "/old/place", "--overwrite_output_dir", "--sp_size", "2"])
    saved = json.loads(json.dumps(config_to_dict(run)))  # as the checkpoint's train_state.json holds it
    cfg = load_config(["--config", str(p), "--max_steps", "5", "--eta", "0.3", "--output_dir", "/new/place",
                       "--resume_from_checkpoint", "latest"])
    overridden, kept = resume_settings(cfg, saved)
    assert cfg.rollout.sde_type == "flow_grpo"  # not given: the run's sampler, not the file's
    assert cfg.model.lora_r == 4  # not given: the run's, not the default
    assert (cfg.optim.max_steps, cfg.rollout.eta) == (5, 0.3)  # given: the flags'
    assert (cfg.checkpoint.output_dir, cfg.checkpoint.resume_from_checkpoint) == ("/new/place", "latest")
    assert cfg.checkpoint.overwrite_output_dir is False  # the first launch's --overwrite_output_dir is not repeated
    assert cfg.parallel.sp_size == 1  # the layout is this launch's (a checkpoint continues on any valid one)
    assert overridden == {"optim.max_steps": (3, 5)}  # eta given with the run's own value: no change
    assert kept == {"rollout.sde_type": ("flow_grpo", "sage_grpo")}  # max_steps is given: overridden, not kept
    assert resume_settings(cfg, saved) == (overridden, kept)  # again (the agreed checkpoint): the same result
    assert cfg.rollout.sde_type == "flow_grpo" and cfg.optim.max_steps == 5
    assert {"sde_type", "lora_r", "flow_shift", "cfg_scale"} <= cfg.explicit  # the model's own defaults stay off


@pytest.mark.parametrize("text,expected", [("True", True), ("false", False), ("1", True), ("0", False),
                                           ("yes", True), ("NO", False), ("on", True), ("off", False)])
def test_boolean_forms(text, expected):
    assert parse_bool(text) is expected
    assert load_config(["--use_lora", text]).model.use_lora is expected


@pytest.mark.parametrize("text,expected", [("480x864", (480, 864)), ("16X32", (16, 32)), (" 352x624 ", (352, 624))])
def test_sizes_parse(text, expected):
    assert parse_size(text, "--fixed_size") == expected


@pytest.mark.parametrize("text", ["480", "480x", "x864", "480x864x2", "-16x32", "4.5x8", "480*864", ""])
def test_malformed_sizes_are_one_error_naming_the_flag(text):
    with pytest.raises(SageGRPOError, match=r"^--fixed_size must be HxW .*got "):
        parse_size(text, "--fixed_size")


def test_bare_boolean_and_lists_and_optional():
    cfg = load_config(["--use_lora", "--validation_prompts", "a cat", "a dog", "--lora_target_modules", "to_q",
                       "to_k", "--kl_target", "2e-5"])
    assert cfg.model.use_lora is True
    assert cfg.validation.validation_prompts == ["a cat", "a dog"]
    assert cfg.model.lora_target_modules == ["to_q", "to_k"]
    assert cfg.kl.kl_target == 2e-5
    assert load_config(["--kl_target", "none"]).kl.kl_target is None


def test_dump_and_load_back_identically(tmp_path):
    cfg = load_config(["--sde_type", "cps", "--eta", "0.9", "--validation_prompts", "x", "--kl_target", "3e-6",
                       "--use_muon", "false"])
    path = tmp_path / "resolved.yaml"
    dump_yaml(cfg, path)
    assert load_config(["--config", str(path)]) == cfg
    assert config_from_dict(yaml.safe_load(path.read_text())) == cfg


@pytest.mark.parametrize("argv,message", [
    (["--sde_typ", "cps"], "unknown flag 'sde_typ'; did you mean sde_type"),
    (["--sde_type", "ddim"], "--sde_type: 'ddim' is not allowed; choose one of: dance_grpo, flow_grpo, sage_grpo, cps"),
    (["--use_lora", "maybe"], "--use_lora: 'maybe' is not a boolean"),
    (["--batch_size", "two"], "--batch_size: 'two' is not a valid int"),
    (["--eta", "abc"], "--eta: 'abc' is not a valid float"),
    (["--report_to", "mlflow"], "choose one of: tensorboard, wandb, none"),
    (["--sample_n_frames", "80"], "--sample_n_frames must be 4k \\+ 1 .* use 77 or 81"),
    (["--validate_video_length", "120"], "--validate_video_length must be 4k \\+ 1 .* use 117 or 121"),
    (["--height", "100"], "--height must be a positive multiple of 16.*try 96"),
    (["--validation_fixed_size", "480x860"], "validation_fixed_size width must be a positive multiple of 16"),
    (["--validation_fixed_size", "big"], "--validation_fixed_size must be HxW"),
    (["--num_generations", "1"], "--num_generations must be >= 2"),
    (["--timestep_fraction", "1.5"], "--timestep_fraction must be in \\(0, 1\\]"),
    (["--timestep_fraction", "0.04"], "--timestep_fraction 0.04 trains int\\(20 x 0.04\\) = 0 of the 20 noisy steps; "
                                      "use at least 0.05"),
    (["--timestep_fraction", "0.05", "--sde_type", "cps"], "int\\(19 x 0.05\\) = 0 of the 19 noisy steps"),
    (["--adam_beta2", "1.0"], "--adam_beta2 must be in \\[0, 1\\), got 1.0"),
    (["--adam_eps", "0"], "--adam_eps must be > 0"),
    (["--reward_weights", "VQ=1"], "--reward_weights must be a JSON object"),
    (["--kl_min_coef", "1e-3"], "need --kl_min_coef \\(0.001\\) <= --kl_coef"),
    (["--kl_coef", "1e-3"], "--kl_coef \\(0.001\\) <= --kl_weight \\(1e-05\\)"),
    (["--kl_target", "-3"], "--kl_target must be >= 0"),
    (["--adv_clip_max", "-1"], "--adv_clip_max must be > 0"),
    (["--max_steps", "1.5e0"], "--max_steps: '1.5e0' is not a valid int"),
    (["--max_steps", "1e-3"], "--max_steps: '1e-3' is not a valid int"),
    (["--seed", "1e400"], "--seed: '1e400' is not a valid int"),
    (["--video_fps", "0"], "--video_fps must be >= 1"),
    (["--reward_sample_fps", "0"], "--reward_sample_fps must be > 0"),
    (["--reward_min_pixels", "300000"], "--reward_min_pixels \\(300000\\) must be <= --reward_max_pixels"),
    (["--grpo_sampling_steps", "100"], "sage_grpo step 0 .* would inject no noise.* use fewer steps"),
    (["--eta", "0"], "--eta must be > 0 for --sde_type sage_grpo: .* nothing learns"),
    (["--sde_type", "cps", "--eta", "0"], "--eta must be > 0 for --sde_type cps"),
    (["--sde_type", "cps", "--eta", "1.5"], "--eta must be <= 1 for cps"),
    (["--clip_range", "0"], "--clip_range must be > 0"),
    (["--batch_size", "0"], "--batch_size must be >= 1"),
    (["--max_steps", "0"], "--max_steps must be >= 1, got 0"),
])
def test_bad_values_name_the_key(argv, message):
    with pytest.raises(SageGRPOError, match=message):
        load_config(argv)


def test_yaml_errors_name_the_key(tmp_path):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("rollout:\n  etta: 0.3\n")
    with pytest.raises(SageGRPOError, match="unknown key in section 'rollout'.*'etta'; did you mean eta"):
        load_config(["--config", str(bad_key)])
    wrong_section = tmp_path / "b.yaml"
    wrong_section.write_text("model:\n  eta: 0.3\n")
    with pytest.raises(SageGRPOError, match="section 'model'"):
        load_config(["--config", str(wrong_section)])
    bad_section = tmp_path / "c.yaml"
    bad_section.write_text("rolout:\n  eta: 0.3\n")
    with pytest.raises(SageGRPOError, match="'rolout'; did you mean rollout"):
        load_config(["--config", str(bad_section)])
    with pytest.raises(SageGRPOError, match="does not exist"):
        load_config(["--config", str(tmp_path / "missing.yaml")])
    broken = tmp_path / "d.yaml"
    broken.write_text("rollout: [\n")
    with pytest.raises(SageGRPOError, match="not valid YAML"):
        load_config(["--config", str(broken)])


@pytest.mark.parametrize("argv,world,message", [
    (["--sp_size", "3"], 8, "--sp_size 3 must divide the world size 8; use one of \\[1, 2, 4, 8\\]"),
    (["--sp_size", "32"], 64, "--sp_size 32 must divide the attention head count 16"),
    (["--batch_size", "1", "--sp_size", "2"], 4, "1 \\* 2 = 2 videos per step is not a multiple of --num_generations "
                                                 "4"),
    (["--dp_replicate", "3"], 4, "--dp_replicate 3 must divide dp_degree"),
    (["--sp_size", "2", "--use_lora", "--lora_dropout", "0.1"], 8, "--lora_dropout 0.1: .*use --lora_dropout 0"),
    (["--use_lora", "--lora_dropout", "0.05"], 1, "--lora_dropout 0.05: the rollout samples with the deterministic "
                                                  "policy .*ratio leaves 1.*use --lora_dropout 0"),
])
def test_geometry_validation(argv, world, message):
    cfg = load_config(argv)
    with pytest.raises(SageGRPOError, match=message):
        validate(cfg, world)


def test_authors_64_gpu_geometry_is_valid():
    cfg = load_config(["--sp_size", "2", "--batch_size", "2", "--num_generations", "4"])
    validate(cfg, 64, training=False)  # dp 32, 64 videos, 16 groups
    validate(load_config(["--batch_size", "4"]), 1, training=False)  # single process: one whole group per step


def test_hsdp_needs_fsdp_under_torchrun():
    argv = ["--dp_replicate", "2", "--train_video_csv", "prompts.csv"]
    validate(load_config(argv), 4)
    with pytest.raises(SageGRPOError, match=r"--dp_replicate 2 \(HSDP\) needs --enable_fsdp under torchrun"):
        validate(load_config([*argv, "--enable_fsdp", "False"]), 4)


def test_a_prompt_file_is_required_for_training_only():
    cfg = load_config(["--batch_size", "4"])
    with pytest.raises(SageGRPOError, match="--train_video_csv is required"):
        validate(cfg, 1)
    validate(cfg, 1, training=False)  # a memory plan of the same config
    validate(load_config(["--batch_size", "4", "--train_video_csv", "prompts.csv"]), 1)


@pytest.mark.parametrize("name,world", [("paper_setting_a", 64), ("paper_setting_b", 64), ("single_node_8gpu", 8),
                                        ("multinode_64gpu", 64), ("tiny_cpu", 1)])
def test_shipped_configs_load_and_validate(name, world):
    path = ROOT / "configs" / f"{name}.yaml"
    assert path.read_text().startswith("#") and "Launch" in path.read_text().split("\n\n")[0]
    cfg = load_config(["--config", str(path), "--train_video_csv", "prompts.csv"])  # as their launch lines pass it
    validate(cfg, world)


def test_paper_settings_differ_only_in_reward_weights_and_output():
    a = config_to_dict(load_config(["--config", str(ROOT / "configs/paper_setting_a.yaml")]))
    b = config_to_dict(load_config(["--config", str(ROOT / "configs/paper_setting_b.yaml")]))
    diff = {(g, k) for g in GROUPS for k in a[g] if a[g][k] != b[g][k]}
    assert diff == {("reward", "reward_weights"), ("checkpoint", "output_dir")}


def test_groups_are_dataclasses_with_unique_flags():
    names = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(FIELDS)


def test_cli_error_is_one_line_and_exit_code_2():
    code = ("from sage_grpo.config import load_config; from sage_grpo.errors import run_cli; "
            "run_cli(load_config, ['--eta', 'x'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --eta: 'x' is not a valid float"


def test_whole_numbers_in_scientific_notation_and_yaml_types(tmp_path):
    assert load_config(["--max_steps", "1e3"]).optim.max_steps == 1000
    assert load_config(["--grpo_sampling_steps", "100", "--sde_type", "flow_grpo"]).rollout.grpo_sampling_steps == 100
    p = tmp_path / "c.yaml"
    p.write_text("validation:\n  validation_prompts: a cat on a mat\n"
                 "reward:\n  reward_weights: {VQ: 1, MQ: 0, TA: 2}\n")
    cfg = load_config(["--config", str(p)])
    assert cfg.validation.validation_prompts == ["a cat on a mat"]
    assert json.loads(cfg.reward.reward_weights) == {"VQ": 1, "MQ": 0, "TA": 2}
    p.write_text("rollout:\n  neg_prompt: no\n")
    with pytest.raises(SageGRPOError, match="--neg_prompt: got the YAML boolean False; quote the text"):
        load_config(["--config", str(p)])


def test_the_shipped_configs_launch_through_the_launchers_and_shard_64_gpus_by_node():
    """Each shipped config names its launch as a launcher (run_post_train*.sh run the pre-flight checks before
    torchrun starts), never bare torchrun; the 64-GPU ones (the paper settings and configs/multinode_64gpu.yaml)
    shard inside a node with one replica per node (HSDP), the layout docs/scaling.md plans; and the set-up script
    installs on a GPU machine the torch pyproject.toml requires. Seen failing with the paper configs' torchrun
    launch lines and full sharding over 64 ranks, and with scripts/_setup.sh's torch>=2.6 against the package's
    torch>=2.9."""
    import re

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert not re.search(r"torchrun\s+--", path.read_text()), path.name  # a torchrun command line
    for name in ("paper_setting_a", "paper_setting_b", "multinode_64gpu"):
        cfg = load_config(["--config", str(ROOT / "configs" / f"{name}.yaml")])
        assert (cfg.parallel.dp_replicate, cfg.parallel.sp_size) == (8, 2), name  # 64 / 8 nodes: a shard group a node
    [needed] = re.findall(r'"torch(>=[\d.]+)"', (ROOT / "pyproject.toml").read_text())
    [installed] = re.findall(r'pip install -q "torch(>=[\d.]+)"', (ROOT / "scripts/_setup.sh").read_text())
    assert installed == needed
