"""A data set whose support is known exactly: angular modes on a circle, in 2-D or embedded in D dimensions.

Data: K modes at angles 2*pi*k/K on a circle of radius R; an angle is drawn from a mode with a small Gaussian
angular jitter, and the point lies exactly on the circle. In D > 2 dimensions the circle is embedded by a fixed
orthonormal basis Q [D, 2] (drawn from `basis_seed`, independent of the run seed, so every run sees the same data).

Because the support (the circle) is known in closed form, the lab measures exactly what the paper can only proxy
with visual metrics: how far samples leave the data manifold, and how many modes survive reward optimisation.

Reward: the projection of the in-plane coordinates onto the direction u of a target mode, r(x) = <Q^T x, u> / R.
On the data it lies in [-1, 1] and is maximal at the target mode, so it "prefers part of the data"; but it also
grows when a sample moves radially outward, off the circle. That is deliberate: like a learned reward model, it
can be exploited off-manifold, which is what the trust regions are meant to prevent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["RingManifold"]


def _orthonormal_basis(dim: int, seed: int) -> Tensor:
    """[dim, 2] orthonormal columns; the identity's first two columns for dim = 2."""
    if dim == 2:
        return torch.eye(2)
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, 2, generator=g, dtype=torch.float64))  # [D, 2]
    return q.float()


@dataclass
class RingManifold:
    """K angular modes on a circle of radius `radius`, embedded in `dim` dimensions."""

    dim: int = 2
    num_modes: int = 8
    radius: float = 1.0
    angle_std: float = 0.12  # radians; modes 2*pi/8 = 0.785 apart, so they stay well separated
    target_mode: int = 0  # the mode the reward prefers
    basis_seed: int = 1234
    basis: Tensor = field(init=False, repr=False)  # [D, 2]

    def __post_init__(self) -> None:
        if self.dim < 2:
            raise ValueError(f"dim must be >= 2, got {self.dim}")
        if self.num_modes < 1 or not 0 <= self.target_mode < self.num_modes:
            raise ValueError(f"need 0 <= target_mode < num_modes, got {self.target_mode}, {self.num_modes}")
        self.basis = _orthonormal_basis(self.dim, self.basis_seed)

    @property
    def mode_angles(self) -> Tensor:
        """[K] angles of the mode centres."""
        return torch.arange(self.num_modes, dtype=torch.float32) * (2.0 * math.pi / self.num_modes)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """n data points -> [n, D], exactly on the circle."""
        k = torch.randint(self.num_modes, (n,), generator=generator)  # [n]
        theta = self.mode_angles[k] + self.angle_std * torch.randn(n, generator=generator)  # [n]
        plane = self.radius * torch.stack([torch.cos(theta), torch.sin(theta)], dim=1)  # [n, 2]
        return plane @ self.basis.T  # [n, D]

    def to_plane(self, x: Tensor) -> Tensor:
        """In-plane coordinates Q^T x -> [n, 2]."""
        return x.float() @ self.basis  # [n, 2]

    def distance_to_support(self, x: Tensor) -> Tensor:
        """Exact Euclidean distance of each point to the embedded circle -> [n].

        With p = Q^T x the in-plane part and x - Q p the out-of-plane residual (orthogonal to the plane), the
        nearest circle point is R p/|p|, so d^2 = (|p| - R)^2 + |x - Q p|^2.
        """
        x = x.float()
        p = self.to_plane(x)  # [n, 2]
        residual = x - p @ self.basis.T  # [n, D]
        radial = p.norm(dim=1) - self.radius  # [n]
        return torch.sqrt(radial**2 + (residual**2).sum(dim=1))

    def assign_modes(self, x: Tensor) -> Tensor:
        """Index of the nearest mode by angle -> LongTensor[n]."""
        p = self.to_plane(x)  # [n, 2]
        theta = torch.atan2(p[:, 1], p[:, 0])  # [n] in (-pi, pi]
        width = 2.0 * math.pi / self.num_modes
        return torch.round(theta / width).long() % self.num_modes

    def reward(self, x: Tensor) -> Tensor:
        """r(x) = <Q^T x, u_target> / R -> [n] (1 at the target mode centre, -1 opposite it)."""
        a = self.mode_angles[self.target_mode]
        u = torch.stack([torch.cos(a), torch.sin(a)])  # [2]
        return self.to_plane(x) @ u / self.radius
