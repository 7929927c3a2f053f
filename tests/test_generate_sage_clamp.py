"""generate.py runs sage_grpo with the config's clamp and refuses a silent schedule with the shared message."""

import pytest

from sage_grpo.errors import SageGRPOError

# 3 steps with shift 200: sigma_1 = 1 - 1/401 = 0.9975 lies above the default clamp 0.997 (step 0 would inject no
# noise) but below 0.999, under which step 0's integral log(0.0025 / 0.001) - 0.0025 is positive
SILENT_BY_DEFAULT = ["--sampler", "sage_grpo", "--num_inference_steps", "3", "--flow_shift", "200"]


def _clamp_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  sage_sigma_clamp: 0.999\n")
    return str(cfg)


def test_generate_refuses_a_silent_schedule_and_takes_the_configs_clamp(tmp_path):
    import generate

    def resolve(argv):
        return generate.resolve_args(generate.build_parser().parse_args(["--prompt", "x", *argv]))

    with pytest.raises(SageGRPOError, match=r"sage_grpo step 0 .*would inject no noise.*fewer steps \(at most 2"):
        resolve(SILENT_BY_DEFAULT)
    assert resolve(["--config", _clamp_config(tmp_path), *SILENT_BY_DEFAULT]).sage_sigma_clamp == 0.999


def test_generate_samples_with_the_configs_clamp(tiny_diffusers_dir, tmp_path):
    import generate

    # the sampler must use the config's clamp too: with the default one sde_step itself refuses step 0
    [path] = generate.main(["--config", _clamp_config(tmp_path), *SILENT_BY_DEFAULT, "--prompt", "a red ball",
                            "--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5",
                            "--fixed_size", "16x32", "--output_path", str(tmp_path / "v.mp4")])
    assert path.is_file()
