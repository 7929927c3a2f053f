"""Shared helpers of the world tests (``from world_fixtures import ...``): one torch thread, and the noisy, blurred
version of a clip that the detectors must still read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """32 px clips are tiny: extra threads only add synchronisation, which on a busy 2-core machine is most of the
    time."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def blur(video: torch.Tensor) -> torch.Tensor:
    """3x3 binomial blur ([1, 2, 1] x [1, 2, 1] / 16, sigma ~0.7 px) of a clip [F, 3, H, W], edges replicated."""
    k = torch.tensor([1.0, 2.0, 1.0])
    k = (k[:, None] * k[None, :]) / 16.0  # [3, 3]
    x = F.pad(video, (1, 1, 1, 1), mode="replicate")  # [F, 3, H+2, W+2]
    return F.conv2d(x, k.view(1, 1, 3, 3).repeat(3, 1, 1, 1), groups=3)


def degrade(video: torch.Tensor, generator: torch.Generator, std: float = 0.05) -> torch.Tensor:
    """Blur, then add Gaussian noise of ``std`` per channel, then clamp to [0, 1]: [F, 3, H, W]."""
    noise = torch.randn(video.shape, generator=generator) * std
    return (blur(video) + noise).clamp(0, 1)
