"""Optimizers of the policy update: Muon for the hidden weight matrices, AdamW for the rest (the authors' default),
a warm-up learning-rate schedule and gradient-norm clipping.

Parameter split (`split_muon_params`)
-------------------------------------
A trainable parameter goes to Muon when both hold:
- it is exactly 2-D (`torch.optim.Muon` refuses anything else; Newton-Schulz orthogonalises a matrix), and
- it lives inside a transformer block: `transformer_blocks.<i>.` (the 54 double-stream blocks) or
  `context_embedder.token_refiner.refiner_blocks.<i>.` (the text token refiner's 2 blocks).
Everything else goes to AdamW: the Conv3d patch embedding `x_embedder` (5-D), the timestep / text / ByT5 / image
embedders and `cond_type_embed` (input embeddings), `norm_out` and `proj_out` (the output layer), every norm weight
and every bias (1-D).
Why: the authors send every >= 2-D parameter to Muon. Muon is an optimizer for hidden layers: its orthogonalised
update assumes a matrix that maps hidden activations to hidden activations; for input embeddings and the output
head AdamW is the established choice (Keller Jordan's Muon post; Moonshot's "Muon is Scalable", arXiv 2502.16982;
the issue that asked for this module), and a 5-D convolution kernel cannot reach torch's Muon at all. The token
refiner's blocks are full transformer blocks (attention, MLP, adaLN modulation) over text tokens, i.e. hidden layers
in the same sense as the main blocks, so they keep the authors' Muon; that is the rule that departs least from the
authors while keeping Muon off the embeddings and the output layer. The adaLN modulation matrices
(`norm1.linear`, `norm1_context.linear`, the refiner's `norm_out.linear`) are hidden 2-D maps of the conditioning
vector inside the blocks and go to Muon as well.
LoRA: peft's `lora_A` (r x in) and `lora_B` (out x r) matrices inside the blocks go to Muon. They are 2-D, so the
authors' rule sends them there, and with `adjust_lr_fn="match_rms_adamw"` their update has the RMS of an AdamW update
(0.2 * sqrt(max(A, B)) times an orthogonalised matrix), so the same learning rate applies to both factors;
orthogonalising an r-row matrix costs next to nothing. `lora_magnitude_vector` (DoRA, 1-D) goes to AdamW. Frozen
parameters (requires_grad False, e.g. the LoRA base weights) go nowhere.
Wrapper prefixes that torch adds to parameter names (`_orig_mod.` from torch.compile, `_checkpoint_wrapped_module.`
from activation checkpointing, `_fsdp_wrapped_module.` from FSDP1, `module.` from DDP) are ignored; FSDP2 keeps the
names unchanged.

Learning rate
-------------
`lr_at(update, peak, warmup)`: linear warm-up over the first `warmup` optimizer updates (update 0 uses
peak / warmup, update warmup - 1 uses peak), then constant at `peak`. No decay: the authors train at a constant
learning rate (their `--warmup_steps` flag is parsed and never used, so their schedule is constant from the first
update; our default `--warmup_steps 0` reproduces that). Call `optimizers.set_lr(lr_at(...))` before every
`step()` with the number of updates already taken: the schedule is a pure function of the update counter, so a
resume needs no scheduler state. Muon and AdamW share the group learning rate; Muon scales it per matrix internally
(`match_rms_adamw`), so the warm-up scales both optimizers (and their decoupled weight decay, lr * wd) alike.

Checkpoints
-----------
`Optimizers.state_dict()` / `load_state_dict()` round-trip exactly (`{"muon": ..., "adamw": ...}` of the torch
optimizers' own state dicts). Loading restores the saved param groups, hyper-parameters included, so a resume then
calls `apply_settings(optimizer_settings(cfg))`: the run's weight decay, betas and eps (a flag given on the resume
overrides the saved run's) are what it trains with, as it says and records. For torch.distributed.checkpoint pass
the list: `get_optimizer_state_dict(model, optimizers=container.optimizers)` and `set_optimizer_state_dict(model,
container.optimizers, state)`; this works with the two optimizers on a plain module in one process without a
process group (tested). `build_optimizer` materialises the optimizer state of every parameter at construction
(`Optimizers.materialize_state`), with no effect on the parameters or on the first real update, because parameters
that never receive a gradient (the last block's `to_add_out` / `ff_context`, the image embedder in t2v) would
otherwise have no state at save time and a DCP load would fail; DCP's own lazy initialisation would also leave
AdamW's step counter at 1 before the first update.

Muon under FSDP2
----------------
Newton-Schulz needs whole matrices while FSDP2 holds row shards: `build_optimizer` picks
`sage_grpo.parallel.muon.ShardedMuon` when the Muon parameters are DTensors (each matrix gathered on an owner rank,
orthogonalised with torch's Newton-Schulz, its rows scattered back; the scheme, its sources and why it subclasses
torch's Muon are in that module's docstring).

Gradient clipping
-----------------
`clip_grad_norm(params, max_norm)` returns the total L2 norm as a float (for logging) and clips only when
max_norm > 0 and the norm is finite. It is `torch.nn.utils.clip_grad_norm_` split into its two public halves
(`get_total_norm`, `clip_grads_with_norm_`, foreach kernels) so that under FSDP2 the norm of the sharded DTensor
gradients (a Partial DTensor) is all-reduced with `full_tensor()` before it is used, as torchtitan's
`clip_grad_norm_` does; every rank then clips with the same global norm. Sequence-parallel gradients must be
summed over the sp group before the call. A non-finite norm leaves the gradients untouched: the caller skips that
update (agreed across ranks).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from sage_grpo.errors import SageGRPOError

__all__ = [
    "MUON_ADJUST_LR_FN",
    "MUON_BLOCK_PATTERN",
    "Optimizers",
    "build_optimizer",
    "clip_grad_norm",
    "goes_to_muon",
    "lr_at",
    "optimizer_settings",
    "split_muon_params",
]

MUON_ADJUST_LR_FN = "match_rms_adamw"  # Moonshot's scaling, lr * 0.2 * sqrt(max(A, B)): the authors' choice
# Hidden transformer blocks whose 2-D weights Muon optimises (names after wrapper prefixes are removed).
MUON_BLOCK_PATTERN = re.compile(r"(^|\.)(transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.")
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"})


def _clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def goes_to_muon(name: str, param: Tensor) -> bool:
    """The split rule for one trainable parameter (see the module docstring): 2-D and inside a transformer block."""
    return param.ndim == 2 and MUON_BLOCK_PATTERN.search(_clean_name(name)) is not None


def split_muon_params(
    named_params: Iterable[tuple[str, Tensor]],
) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """Trainable (name, parameter) pairs -> (muon, adamw), each in the given order; frozen parameters are dropped."""
    muon: list[tuple[str, Tensor]] = []
    adamw: list[tuple[str, Tensor]] = []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (muon if goes_to_muon(name, p) else adamw).append((name, p))
    return muon, adamw


def lr_at(update: int, peak: float, warmup: int) -> float:
    """Learning rate of the optimizer update that follows `update` completed updates (0 = the first update).

    Linear warm-up over `warmup` updates: peak * (update + 1) / warmup, reaching peak at update warmup - 1; then
    constant. warmup <= 0: constant peak from the first update (the authors' behaviour).
    """
    if update < 0:
        raise ValueError(f"update must be >= 0, got {update}")
    if warmup <= 0 or update >= warmup:
        return float(peak)
    return float(peak) * (update + 1) / warmup


def optimizer_settings(optim_cfg) -> dict[str, dict]:
    """The hyper-parameters of each optimizer (by `Optimizers.names`) that the run sets, from `optim_cfg`
    (sage_grpo.config.OptimConfig), the learning rate aside (the schedule sets it before every step, `set_lr`).
    The one place they are read: `build_optimizer` builds with them, and a resume applies them again
    (`Optimizers.apply_settings`) after loading a state dict, which brings back the saved run's. Muon keeps torch's
    momentum, Nesterov and Newton-Schulz settings (no flag sets them)."""
    wd = float(optim_cfg.weight_decay)
    return {"muon": {"weight_decay": wd, "adjust_lr_fn": MUON_ADJUST_LR_FN},
            "adamw": {"weight_decay": wd, "betas": (float(optim_cfg.adam_beta1), float(optim_cfg.adam_beta2)),
                      "eps": float(optim_cfg.adam_eps)}}


class Optimizers:
    """Several torch optimizers over disjoint parameters, driven as one (like torchtitan's OptimizersContainer).

    `names[i]` labels `optimizers[i]` ("muon", "adamw") in `state_dict()`. For torch.distributed.checkpoint pass
    `optimizers` (the list) to get/set_optimizer_state_dict.
    """

    def __init__(self, optimizers: list[Optimizer], names: list[str]):
        if len(optimizers) != len(names) or len(set(names)) != len(names) or not optimizers:
            raise ValueError(f"need one unique name per optimizer, got {names} for {len(optimizers)} optimizers")
        self.optimizers = list(optimizers)
        self.names = list(names)

    def __getitem__(self, name: str) -> Optimizer:
        return self.optimizers[self.names.index(name)]

    @property
    def param_groups(self) -> list[dict]:
        """All param groups of all optimizers (the dicts themselves: setting a key changes the optimizer)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def set_lr(self, lr: float) -> None:
        """Set the (base) learning rate of every group; Muon applies its per-matrix scaling on top."""
        for g in self.param_groups:
            g["lr"] = lr

    def apply_settings(self, settings: dict[str, dict]) -> None:
        """Set every param group of each optimizer to `settings[name]` (optimizer_settings), the other keys (the
        learning rate, torch's own flags) left as they are: after `load_state_dict`, whose param groups are the
        saved run's, the optimizer steps with this run's hyper-parameters."""
        for name, opt in zip(self.names, self.optimizers):
            for g in opt.param_groups:
                g.update(settings[name])

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, dict]:
        """{name: optimizer.state_dict()}; like torch's, the state tensors are the live ones (not copies)."""
        return {name: opt.state_dict() for name, opt in zip(self.names, self.optimizers)}

    def load_state_dict(self, state_dict: dict[str, dict]) -> None:
        if sorted(state_dict) != sorted(self.names):
            raise SageGRPOError(
                f"optimizer checkpoint holds {sorted(state_dict)} but this run builds {sorted(self.names)} "
                "(--use_muon or the trainable parameters differ from the saved run)"
            )
        for name, opt in zip(self.names, self.optimizers):
            opt.load_state_dict(state_dict[name])

    @torch.no_grad()
    def materialize_state(self) -> None:
        """Create the state of every parameter now, as if each optimizer had been built and never stepped.

        One step with zero gradients at learning rate 0 (what DCP's own initialisation does), then the step
        counters go back to 0: parameters are untouched (p * (1 - 0 * wd) and + (-0) updates are exact), the
        moments and momentum buffers stay zero, and the first real update is the same as without this call.
        Refused while any parameter holds a gradient (that gradient would enter the moments).
        """
        params = self.params()
        if any(p.grad is not None for p in params):
            raise RuntimeError("materialize_state needs all gradients to be None (call it before the first backward)")
        saved_lr = [g["lr"] for g in self.param_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            self.set_lr(0.0)
            self.step()
        finally:
            for g, lr in zip(self.param_groups, saved_lr):
                g["lr"] = lr
            for p in params:
                p.grad = None
        for opt in self.optimizers:
            for state in opt.state.values():
                step = state.get("step")
                if isinstance(step, Tensor):
                    step.zero_()
                elif step is not None:
                    state["step"] = 0


def _is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def build_optimizer(named_params: Iterable[tuple[str, Tensor]], optim_cfg, *, materialize: bool = True) -> Optimizers:
    """Muon (2-D block weights) + AdamW (the rest), or AdamW alone when `optim_cfg.use_muon` is False.

    optim_cfg: an object with `learning_rate`, `weight_decay`, `use_muon`, `adam_beta1`, `adam_beta2`, `adam_eps`
    (sage_grpo.config.OptimConfig). Both optimizers use `learning_rate` and `weight_decay` (decoupled, on every
    trainable parameter as in the authors' code); Muon keeps torch's defaults (momentum 0.95, Nesterov, 5 quintic
    Newton-Schulz steps in bf16) with adjust_lr_fn="match_rms_adamw"; AdamW takes the authors' betas (0.95, 0.95)
    and eps 1e-8 by default (torch's betas are (0.9, 0.999)), from the config. An empty side is
    left out (LoRA only in the blocks: Muon alone). materialize: create all optimizer state now (see
    `Optimizers.materialize_state`; needed for DCP when some parameters never get a gradient).
    """
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if not named:
        raise SageGRPOError("no trainable parameters to optimise")
    lr, settings = float(optim_cfg.learning_rate), optimizer_settings(optim_cfg)
    if optim_cfg.use_muon:
        muon, adamw = split_muon_params(named)
    else:
        muon, adamw = [], named
    optimizers: list[Optimizer] = []
    names: list[str] = []
    if muon:
        muon_cls = torch.optim.Muon
        if any(_is_dtensor(p) for _, p in muon):  # FSDP2 shards: whole matrices on owner ranks (parallel/muon.py)
            from sage_grpo.parallel.muon import ShardedMuon as muon_cls
        optimizers.append(muon_cls([p for _, p in muon], lr=lr, **settings["muon"]))
        names.append("muon")
    if adamw:
        optimizers.append(torch.optim.AdamW([p for _, p in adamw], lr=lr, **settings["adamw"]))
        names.append("adamw")
    container = Optimizers(optimizers, names)
    if materialize:
        container.materialize_state()
    return container


def clip_grad_norm(params: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> float:
    """Total gradient norm of `params` as a float; grads are scaled to `max_norm` when max_norm > 0 and the norm
    exceeds it. max_norm <= 0 only measures. A non-finite norm is returned and the gradients are left alone.

    FSDP2: the gradients are Shard(0) DTensors and their norm a Partial DTensor; `full_tensor()` all-reduces it
    over the mesh so every rank clips with, and returns, the same global norm (collective: call on all ranks).
    foreach=True (CPU and accelerators): torch's automatic choice would fall back to a per-tensor loop for DTensor
    gradients, which are not "native" tensors.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
    if hasattr(total, "full_tensor"):  # DTensor (FSDP2): reduce the partial norms over the mesh
        total = total.full_tensor()
    norm = float(total)
    if max_norm > 0 and math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return norm
