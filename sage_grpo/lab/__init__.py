"""A seconds-scale CPU lab for the algorithm (docs/labs.md): GRPO on a small flow model with a known data manifold.

- `data`: a ring of angular modes, in 2-D or embedded in D dimensions, with an exact distance to the support
  and a reward that prefers one mode (and can be exploited off-manifold).
- `model`: an MLP velocity field pre-trained by rectified flow matching in seconds.
- `grpo`: the GRPO loop built on the package's `sde_step`, `group_advantages`, `clipped_policy_loss`,
  `equalizer_weights` and KL machinery.
- `metrics`: reward, off-manifold distance, mode coverage/entropy, per-step gradient norms (Fig. 3-4).
- `report`: the Table-2-shaped table, CSV and figures used by scripts/lab_ablation.py.
- `video`: the video lab's cell flags, rows, table and figures (scripts/video_ablation.py: the same grid as
  post_train.py runs on the tiny world model; docs/labs.md "Video lab").
"""

from .data import RingManifold
from .grpo import KL_VARIANTS, LAB_SAMPLERS, LabConfig, RunResult, rollout, summarize, train_grpo
from .metrics import log_spread, per_step_grad_norms, sample_metrics
from .model import VelocityMLP, ode_sample, pretrain_flow

__all__ = [
    "KL_VARIANTS",
    "LAB_SAMPLERS",
    "LabConfig",
    "RingManifold",
    "RunResult",
    "VelocityMLP",
    "log_spread",
    "ode_sample",
    "per_step_grad_norms",
    "pretrain_flow",
    "rollout",
    "sample_metrics",
    "summarize",
    "train_grpo",
]
