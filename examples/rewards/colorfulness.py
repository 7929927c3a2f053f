"""An example reward brought by import path: `--reward_model examples/rewards/colorfulness.py:build`.

Colourfulness of Hasler and Suesstrunk (2003), per frame, mean over frames: sqrt(std_rg^2 + std_yb^2) +
0.3 sqrt(mean_rg^2 + mean_yb^2) with rg = R - G, yb = (R + G) / 2 - B on RGB in [0, 1]. 0 for grey videos, about
0.5-0.6 for saturated ones. Needs only torch; no weights, deterministic. docs/rewards.md explains the protocol.
"""

import torch


class Colorfulness:
    components = ("colorfulness",)  # the names it returns, each a tensor [B]
    default_weights = {"colorfulness": 1.0}  # used when --reward_weights is empty

    def __call__(self, videos: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        r, g, b = videos.float().clamp(0, 1).unbind(dim=2)  # videos [B, F, 3, H, W] -> each [B, F, H, W]
        rg, yb = r - g, 0.5 * (r + g) - b
        std = (rg.flatten(2).var(2, unbiased=False) + yb.flatten(2).var(2, unbiased=False)).sqrt()  # [B, F]
        mean = (rg.flatten(2).mean(2) ** 2 + yb.flatten(2).mean(2) ** 2).sqrt()  # [B, F]
        return {"colorfulness": (std + 0.3 * mean).mean(dim=1)}  # [B]


def build(**kwargs) -> Colorfulness:
    """Called with the keyword arguments of the built-in builders (device, dtype, sample_fps, ...); ignores them."""
    return Colorfulness()
