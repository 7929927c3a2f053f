"""The reference policy pi_ref of the position KL (docs/algorithm.md "The rest of the algorithm": KL_pos).

Full fine-tuning: a frozen copy of the transformer (on CPU between uses with `reference_mode_offload`; under FSDP2 a
sharded copy whose offload is FSDP2's own). LoRA: never a second model: the fixed anchor is the base with the adapter
disabled, the moving anchor a second set of adapter weights swapped into the adapter for its forwards.

The anchor holds weights only. Its bookkeeping (whether it equals the current policy, the update of its last
refresh) is resumable state and lives in post_train's `TrainState`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from sage_grpo.config import Config, torch_dtype
from sage_grpo.kl import uses_position_kl

__all__ = ["Anchor"]


class Anchor:
    """`uses_pos`: the run has a KL_pos term (else the anchor holds nothing). `moving`: refreshed every `every`
    optimizer updates. `model`: the anchor's own module (full fine-tuning), None for LoRA; `adapter`: the moving LoRA
    anchor's adapter weights (this rank's shards under FSDP2)."""

    def __init__(self, transformer: torch.nn.Module, cfg: Config, info, *, sharded: bool):
        self.uses_pos = uses_position_kl(cfg.kl)
        self.moving = cfg.kl.use_moving_KL and self.uses_pos
        self.every = cfg.kl.update_ref_model_step
        self.offload = cfg.kl.reference_mode_offload
        self.lora = cfg.model.use_lora
        self.device = info.device
        self.sharded = None  # the FSDP2 anchor (full fine-tuning under FSDP2): offload is FSDP2's own
        self.transformer = transformer
        self.model = None
        self.adapter: dict[str, torch.Tensor] | None = None
        # A fixed LoRA anchor is the base with the adapter disabled: the initial policy only while the adapter is
        # zero (B = 0 at injection), not when it starts from --pretrained_lora_path
        self.equals_initial_policy = not (self.lora and not self.moving and cfg.model.pretrained_lora_path)
        if not self.uses_pos:
            return
        if self.lora:
            if self.moving:
                from sage_grpo.models.lora import adapter_parameters
                from sage_grpo.parallel.fsdp import clone_local_shards

                self.adapter = clone_local_shards(adapter_parameters(transformer))
        elif sharded:
            from sage_grpo.models.parallelize import build_sharded_anchor

            self.sharded = build_sharded_anchor(transformer, info, param_dtype=torch_dtype(cfg.model.dtype),
                                                offload=self.offload)
            self.model = self.sharded.module  # sequence parallelism applied inside
        else:
            self.model = copy.deepcopy(transformer).requires_grad_(False).eval()
            if self.offload:
                self.model.to("cpu")

    def due(self, updates: int, refreshed_at: int) -> bool:
        """Whether a moving anchor refreshed at update `refreshed_at` is due for a refresh at update `updates`."""
        return self.moving and updates - refreshed_at >= self.every

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the policy into the anchor (parameter to parameter: each rank its own shards under FSDP2, no
        collective, no full tensor)."""
        from sage_grpo.parallel.fsdp import copy_local_shards_

        if self.lora:
            from sage_grpo.models.lora import adapter_parameters

            live = adapter_parameters(self.transformer)
            copy_local_shards_([self.adapter[k] for k in live], list(live.values()))
        elif self.sharded is not None:
            self.sharded.refresh()
        else:
            copy_local_shards_(list(self.model.parameters()), list(self.transformer.parameters()))

    @contextmanager
    def active(self):
        """Within: the yielded module computes the anchor's forward."""
        if self.lora and not self.moving:
            self.transformer.disable_adapters()
            try:
                yield self.transformer
            finally:
                self.transformer.enable_adapters()
        elif self.lora:
            from sage_grpo.models.lora import adapter_parameters
            from sage_grpo.parallel.fsdp import clone_local_shards, copy_local_shards_

            live = adapter_parameters(self.transformer)
            saved = clone_local_shards(live)
            copy_local_shards_(list(live.values()), [self.adapter[k] for k in live])
            try:
                yield self.transformer
            finally:
                copy_local_shards_(list(live.values()), [saved[k] for k in live])
        else:
            move = self.offload and self.sharded is None  # FSDP2 brings offloaded shards to the device itself
            if move:
                self.model.to(self.device)
            try:
                yield self.model
            finally:
                if move:
                    self.model.to("cpu")
