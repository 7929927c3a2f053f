"""torchrun worker (2 gloo ranks) for tests/test_parallel_fsdp.py's rollout tests, on the tiny HunyuanVideo-1.5
(2 double-stream blocks + 1 refiner block) with fp32 master weights and bf16 compute (predict_velocity's autocast):

- precision: the dtypes the root and every FSDP2 block see (forward pre-hooks) and the velocity of
  `predict_velocity` (with and without CFG) under FSDP2, against the single-process path on the same weights and
  inputs (fp32 master weights, and the same weights rounded to bf16); once with the project's MixedPrecisionPolicy
  and once with FSDP2's default cast_forward_inputs=True (the old policy); the sharded anchor's policy and velocity;
- rollout: `sage_grpo.rollout.rollout` with and without `keep_unsharded`: trajectories and all-gather counts
  (a dispatch mode), the parameters resharded and FSDP2's reshard settings restored afterwards, and a training
  forward + backward after it.

Writes rank{r}.json (numbers the test checks) to argv[1]."""

import copy
import inspect
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sage_grpo.parallel.fsdp as fsdp  # noqa: E402
from sage_grpo.models.parallelize import build_sharded_anchor, parallelize, transformer_blocks  # noqa: E402
from sage_grpo.models.text_cache import TextConditioning  # noqa: E402
from sage_grpo.parallel.dist import init_distributed  # noqa: E402
from sage_grpo.rollout import SamplerSettings, predict_velocity, rollout  # noqa: E402

out_dir = Path(sys.argv[1])
info = init_distributed()
res: dict = {}
BF16, FP32 = torch.bfloat16, torch.float32
SETTINGS = SamplerSettings(num_steps=3, cfg_scale=6.0, compute_dtype=BF16, autocast=True, master_dtype=FP32)


def tiny_transformer():
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.attention import use_valid_token_attention
    from sage_grpo.models.tiny import tiny_transformer_config

    torch.manual_seed(0)
    m = HunyuanVideo15Transformer3DModel(**{**tiny_transformer_config(), "num_layers": 2})
    use_valid_token_attention(m)
    return m.eval()


def conditioning(seed: int, b: int) -> TextConditioning:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, 6, dtype=torch.long)
    for i in range(b):
        mask[i, : 3 + i] = 1
    return TextConditioning(torch.randn(b, 6, 32, generator=g), mask, torch.randn(b, 4, 16, generator=g),
                            torch.tensor([[1, 1, 0, 0]] * b))


B = 2
COND, UNCOND = conditioning(1, B), conditioning(2, B)
LATENTS = torch.randn(B, 4, 2, 4, 4, generator=torch.Generator().manual_seed(3))
SIGMA = torch.tensor([0.937, 0.41], dtype=torch.float64)  # 1000 sigma is not a bf16 number: t would move


def record_input_dtypes(model) -> dict:
    """Forward pre-hooks on the root and every FSDP2 block: {module: {input name: dtype}} of the first call, the
    rotary (cos, sin) pair as name.0 / name.1. Registered after fully_shard, they run after FSDP2's own pre-hook
    (prepended), so they see what the module's forward gets."""
    seen: dict = {}
    units = {"root": model} | {f"block{i}": b for i, b in enumerate(transformer_blocks(model))}
    for name, mod in units.items():
        sig = inspect.signature(mod.forward)

        def hook(m, args, kwargs, name=name, sig=sig):
            if name in seen:
                return
            bound = sig.bind_partial(*args, **kwargs).arguments
            rec = {}
            for k, v in bound.items():
                for j, t in enumerate(v if isinstance(v, (tuple, list)) else [v]):
                    if torch.is_tensor(t) and t.is_floating_point():
                        rec[k if not isinstance(v, (tuple, list)) else f"{k}.{j}"] = str(t.dtype)
            seen[name] = rec

        mod.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def velocity(model, cfg_scale: float = SETTINGS.cfg_scale) -> torch.Tensor:
    with torch.no_grad():
        return predict_velocity(model, LATENTS, SIGMA, COND, UNCOND, replace(SETTINGS, cfg_scale=cfg_scale),
                                image_tokens=4)


def old_policy(param_dtype, master_dtype):
    """The policy before the fix: FSDP2's default cast_forward_inputs=True."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None if param_dtype == master_dtype else param_dtype,
                                reduce_dtype=torch.float32)


def shard(model):
    return parallelize(model, info, fsdp=True, param_dtype=BF16, master_dtype=FP32)


# ------------------------------------------------------------------------------------------------ precision

ref = tiny_transformer()
ref_seen = record_input_dtypes(ref)
v_ref, v_ref_cfg = velocity(ref, 1.0), velocity(ref)  # one process: fp32 master weights, bf16 autocast
# one process with the weights rounded to bf16, which is what FSDP2's bf16 all-gather hands the forward
ref_bf16 = copy.deepcopy(ref).to(BF16)
bf16_seen = record_input_dtypes(ref_bf16)
v_bf16, v_bf16_cfg = velocity(ref_bf16, 1.0), velocity(ref_bf16)

new = shard(copy.deepcopy(ref))
new_seen = record_input_dtypes(new)
v_new, v_new_cfg = velocity(new, 1.0), velocity(new)

patched = fsdp.mixed_precision_policy
fsdp.mixed_precision_policy = old_policy  # shard_modules looks the policy up at call time
try:
    old = shard(copy.deepcopy(ref))
finally:
    fsdp.mixed_precision_policy = patched
old_seen = record_input_dtypes(old)
v_old, v_old_cfg = velocity(old, 1.0), velocity(old)

new.reshard()  # FSDP2 keeps the root gathered after a no-grad forward; the anchor copies shards
anchor = build_sharded_anchor(new, info, param_dtype=BF16)
anchor_seen = record_input_dtypes(anchor.module)
v_anchor = velocity(anchor.module)


def policies(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m._get_fsdp_state()._mp_policy for m in model.modules() if isinstance(m, FSDPModule)]


def maxdiff(a, b) -> float:
    return float((a - b).abs().max())


res["precision"] = {
    "ref_dtypes": ref_seen, "bf16_dtypes": bf16_seen, "new_dtypes": new_seen, "old_dtypes": old_seen,
    "anchor_dtypes": anchor_seen,
    "v_max": float(v_ref.abs().max()), "v_max_cfg": float(v_ref_cfg.abs().max()),
    "diff_new": maxdiff(v_new, v_ref), "diff_old": maxdiff(v_old, v_ref),
    "diff_new_cfg": maxdiff(v_new_cfg, v_ref_cfg), "diff_old_cfg": maxdiff(v_old_cfg, v_ref_cfg),
    "new_equals_bf16_weights": bool(torch.equal(v_new, v_bf16) and torch.equal(v_new_cfg, v_bf16_cfg)),
    "old_equals_bf16_weights": bool(torch.equal(v_old, v_bf16) or torch.equal(v_old_cfg, v_bf16_cfg)),
    "anchor_equals_policy": bool(torch.equal(v_anchor, v_new_cfg)),
    "anchor_policy_same": [str(p) for p in policies(anchor.module)] == [str(p) for p in policies(new)],
    "cast_forward_inputs": sorted({p.cast_forward_inputs for p in policies(new) + policies(anchor.module)}),
}
del old, anchor

# ------------------------------------------------------------------------------------------------ rollout


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def all_unsharded(model) -> list[bool]:
    return [all(g.is_unsharded for g in m._get_fsdp_state()._fsdp_param_groups) for m in fsdp_modules(model)]


def reshard_settings(model) -> list[bool]:
    """Per FSDP2 unit: does it reshard after forward (FSDP2 keeps None as the post-forward mesh when it does not)."""
    return [all(g.post_forward_mesh_info is not None for g in m._get_fsdp_state()._fsdp_param_groups)
            for m in fsdp_modules(model)]


class CountAllGathers(TorchDispatchMode):
    """Counts the all-gather collectives dispatched inside it (CommDebugMode's module tracker fails on these
    modules). FSDP2 gathers with dist.all_gather_single, which reaches the dispatcher as c10d._allgather_base_;
    any c10d all-gather op counts, so a change of FSDP2's API cannot hide one."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("c10d.") and "allgather" in name:
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return sum(self.ops.values())


def run_rollout(model, keep: bool):
    mode = CountAllGathers()
    with mode, fsdp.keep_unsharded(model, enabled=keep):
        traj = rollout(model, COND, UNCOND, prompts=["a", "b"], prompt_ids=torch.arange(B),
                       generation_ids=torch.zeros(B, dtype=torch.long), prompt_seeds=torch.tensor([11, 12]),
                       latent_shape=(4, 2, 4, 4), settings=SETTINGS, image_tokens=4, base_seed=5, chunk_size=1)
        inside = all_unsharded(model)
    return traj, mode.count, inside, mode.ops


def train_after(model) -> tuple[int, list]:
    """Two training forwards + backward after the rollout: all-gathers and the gradients."""
    model.train()
    mode = CountAllGathers()
    with mode:
        loss = sum(predict_velocity(model, LATENTS, SIGMA, COND, UNCOND, SETTINGS, image_tokens=4).pow(2).mean()
                   for _ in range(2))
    gathers_fwd = mode.count
    loss.backward()
    grads = [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]
    model.eval()
    return gathers_fwd, grads


base, kept = shard(copy.deepcopy(ref)), shard(copy.deepcopy(ref))
traj_b, n_base, inside_b, ops = run_rollout(base, keep=False)
base_settings = reshard_settings(base)  # FSDP2's own, after its lazy init at the first forward
traj_k, n_kept, inside_k, _ = run_rollout(kept, keep=True)
after_settings, after_unsharded = reshard_settings(kept), all_unsharded(kept)
fwd_b, grads_b = train_after(base)
fwd_k, grads_k = train_after(kept)
res["rollout"] = {
    "units": len(fsdp_modules(kept)), "blocks": len(transformer_blocks(kept)),
    "forwards": SETTINGS.num_steps * B,  # T steps x B / chunk_size transformer calls
    "gather_ops": ops, "gathers_base": n_base, "gathers_kept": n_kept,
    "latents_equal": bool(torch.equal(traj_b.latents, traj_k.latents)),
    "log_probs_equal": bool(torch.equal(traj_b.log_probs, traj_k.log_probs)),
    "latents_moved": float((traj_k.latents[:, -1] - traj_k.latents[:, 0]).abs().max()),
    "inside_unsharded_kept": inside_k, "inside_unsharded_base": inside_b,
    "base_settings": base_settings, "after_settings": after_settings, "after_unsharded": after_unsharded,
    "train_gathers_base": fwd_b, "train_gathers_kept": fwd_k,
    "grads_equal": len(grads_b) == len(grads_k) > 0 and all(torch.equal(a, b) for a, b in zip(grads_b, grads_k)),
}

(out_dir / f"rank{info.rank}.json").write_text(json.dumps(res, indent=1))
torch.distributed.destroy_process_group()
