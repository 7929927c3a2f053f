"""The toy flow: an MLP velocity field v(x, sigma), pre-trained by rectified flow matching in seconds.

Same conventions as the video model (docs/algorithm.md "The samplers"): x_sigma = (1 - sigma) * x0 + sigma * eps, the
network predicts v ~ eps - x0, sampling runs sigma from 1 to 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..schedule import sigma_schedule
from ..sde import sde_step
from .data import RingManifold

__all__ = ["VelocityMLP", "mlp_flops", "pretrain_flow", "ode_sample"]


class VelocityMLP(nn.Module):
    """v(x, sigma): x [B, D] and sigma [B] -> [B, D]. sigma enters through Fourier features."""

    def __init__(self, dim: int, hidden: int = 128, depth: int = 3, num_freqs: int = 8) -> None:
        super().__init__()
        self.dim, self.hidden, self.depth, self.num_freqs = dim, hidden, depth, num_freqs
        self.register_buffer("freqs", math.pi * 2.0 ** torch.arange(num_freqs, dtype=torch.float32) / 4.0)
        layers: list[nn.Module] = []
        width = dim + 1 + 2 * num_freqs
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor, sigma: Tensor) -> Tensor:
        sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device).expand(x.shape[0])  # [B]
        angles = sigma[:, None] * self.freqs  # [B, F]
        feats = torch.cat([x, sigma[:, None], torch.sin(angles), torch.cos(angles)], dim=1)  # [B, D + 1 + 2F]
        return self.net(feats)

    def config(self) -> dict:
        """Constructor arguments (stored with cached weights)."""
        return {"dim": self.dim, "hidden": self.hidden, "depth": self.depth, "num_freqs": self.num_freqs}


def mlp_flops(model: VelocityMLP) -> dict[str, int]:
    """Model FLOPs of one sample through `model` (one multiply-add = 2 FLOPs, the matrix products only, as
    sage_grpo.flops counts the video model): {"forward", "backward"}. The backward of a trained MLP computes every
    linear's weight gradient and every input gradient but the first layer's (its input, x and the Fourier features
    of sigma, needs none): 2x the forward less the first layer's input gradient. The activations and the Fourier
    features are left out (under 1 % at hidden 128)."""
    linears = [m for m in model.net if isinstance(m, nn.Linear)]
    per_layer = [2 * m.in_features * m.out_features for m in linears]
    return {"forward": sum(per_layer), "backward": 2 * sum(per_layer) - per_layer[0]}


def pretrain_flow(
    data: RingManifold,
    *,
    seed: int,
    steps: int = 2000,
    batch_size: int = 256,
    lr: float = 1e-2,
    hidden: int = 128,
    depth: int = 3,
) -> VelocityMLP:
    """Rectified-flow matching on `data` -> a trained VelocityMLP (eval mode, deterministic for a seed).

    sigma is drawn uniformly in (0, 1); the loss is || v(x_sigma, sigma) - (eps - x0) ||^2. A cosine learning-rate
    decay to 0 makes the final weights insensitive to the last few noisy batches.
    """
    torch.manual_seed(seed)  # parameter initialisation
    g = torch.Generator().manual_seed(seed + 1)
    model = VelocityMLP(data.dim, hidden=hidden, depth=depth)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for _ in range(steps):
        x0 = data.sample(batch_size, generator=g)  # [B, D]
        eps = torch.randn(x0.shape, generator=g)  # [B, D]
        sigma = torch.rand(batch_size, generator=g)  # [B]
        x = (1.0 - sigma[:, None]) * x0 + sigma[:, None] * eps  # [B, D]
        loss = ((model(x, sigma) - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.eval()


@torch.no_grad()
def ode_sample(model: nn.Module, noise: Tensor, num_steps: int, shift: float) -> Tensor:
    """Deterministic Euler sampling from `noise` [B, D] with the package's "ode" step -> x0 [B, D]."""
    sigmas = sigma_schedule(num_steps, shift)  # [T + 1]
    x = noise
    for t in range(num_steps):
        s, s_next = float(sigmas[t]), float(sigmas[t + 1])
        v = model(x, torch.full((x.shape[0],), s))
        x = sde_step("ode", v, x, s, s_next, 0.0).prev_sample
    return x
