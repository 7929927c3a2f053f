import torch

from sage_grpo.config import load_config
from sage_grpo.rollout import SamplerSettings


def test_sampler_settings_follow_the_config():
    cfg = load_config(["--sde_type", "cps", "--eta", "0.7", "--grpo_sampling_steps", "12", "--flow_shift", "3",
                       "--cfg_scale", "1", "--cps_logprob", "normalized",
                       "--sage_sigma_clamp", "0.99", "--dtype", "bf16", "--master_weight_type", "fp32"])
    s = SamplerSettings.from_config(cfg)
    assert (s.sde_type, s.eta, s.num_steps, s.shift, s.cfg_scale) == ("cps", 0.7, 12, 3.0, 1.0)
    assert (s.cps_logprob, s.sage_clamp) == ("normalized", 0.99)
    assert s.compute_dtype == torch.bfloat16 and s.autocast and not s.use_cfg
    tiny = SamplerSettings.from_config(load_config(["--config", "configs/tiny_cpu.yaml"]))
    assert tiny.compute_dtype == torch.float32 and not tiny.autocast and tiny.use_cfg and tiny.num_steps == 8
