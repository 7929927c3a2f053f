"""torchrun worker (2 gloo ranks) for tests/test_parallel_fsdp.py::test_fsdp_step*: FSDP2 training steps against
one process, ShardedMuon against torch.optim.Muon, DTensor-aware clipping, and the gradient divide factor under
sp / HSDP layouts. Writes rank{r}.json (numbers the test checks) to argv[1]."""

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

from sage_grpo.config import OptimConfig  # noqa: E402
from sage_grpo.models.parallelize import parallelize  # noqa: E402
from sage_grpo.optim import build_optimizer, clip_grad_norm  # noqa: E402
from sage_grpo.parallel.dist import DistInfo, build_mesh, init_distributed  # noqa: E402
from sage_grpo.parallel.fsdp import shard_modules  # noqa: E402
from sage_grpo.parallel.muon import ShardedMuon  # noqa: E402

out_dir = Path(sys.argv[1])
info = init_distributed()
rank, world = info.rank, info.world_size
res: dict = {}


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def maxdiff(model, ref, what="param"):
    """max |sharded - reference| over parameters (what='param') or gradients (what='grad')."""
    worst = 0.0
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        a = full(p if what == "param" else p.grad)
        b = ref_params[n] if what == "param" else ref_params[n].grad
        if a is None and b is None:
            continue
        worst = max(worst, float((a - b).detach().abs().max()))
    return worst


def tiny_transformer(seed=0):
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.attention import use_valid_token_attention
    from sage_grpo.models.tiny import tiny_transformer_config

    torch.manual_seed(seed)
    m = HunyuanVideo15Transformer3DModel(**{**tiny_transformer_config(), "num_layers": 2})
    use_valid_token_attention(m)
    return m


def batch(seed, b=4):
    """A global batch of b samples with different valid text lengths."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, 6, dtype=torch.long)
    for i in range(b):
        mask[i, : 2 + i % 4] = 1
    return dict(hidden_states=torch.randn(b, 9, 2, 4, 4, generator=g), timestep=torch.linspace(100, 900, b),
                encoder_hidden_states=torch.randn(b, 6, 32, generator=g), encoder_attention_mask=mask,
                encoder_hidden_states_2=torch.randn(b, 4, 16, generator=g),
                encoder_attention_mask_2=torch.tensor([[1, 1, 0, 0]] * b), image_embeds=torch.zeros(b, 4, 16))


def loss_of(model, inputs, sl=slice(None)):
    x = {k: v[sl] for k, v in inputs.items()}
    y = model(**x, return_dict=False)[0]
    return y.float().pow(2).mean(dim=(1, 2, 3, 4)).mul(torch.arange(1.0, 5.0)[sl]).mean()  # per-sample weights


def train_case(use_muon: bool, steps: int = 2):
    """`steps` FSDP2 updates on 2 ranks (2 samples each) vs one process on the same 4 samples."""
    ref = tiny_transformer()
    ref.enable_gradient_checkpointing()
    model = parallelize(copy.deepcopy(ref), info, fsdp=True, gradient_checkpointing=True)
    ref.train()
    model.train()
    # AdamW's eps 1e-3 (not 1e-8): its first update is lr * g / (|g| + eps), which with eps 1e-8 is lr * sign(g) for
    # all but the tiniest elements, so an element near 0 whose float noise differs (sharded vs one process) moves by
    # up to 2 lr; with eps 1e-3 the update is Lipschitz in g (constant lr / eps = 10) and the weights differ about as
    # little as the gradients. lr 1e-2 keeps the step well above the 1e-3 "the weights moved" check.
    ocfg = dataclasses.replace(OptimConfig(), learning_rate=1e-2, weight_decay=0.1, use_muon=use_muon, adam_eps=1e-3)
    opt_ref = build_optimizer(list(ref.named_parameters()), ocfg)
    opt = build_optimizer(list(model.named_parameters()), ocfg)
    case = {"muon_class": type(opt["muon"]).__name__ if use_muon else None}
    mine = slice(2 * rank, 2 * rank + 2)
    for step in range(steps):
        inputs = batch(step)
        loss_of(ref, inputs).backward()
        loss_of(model, inputs, mine).backward()  # FSDP2 averages the two ranks' means = the global mean
        case[f"grad_diff_{step}"] = maxdiff(model, ref, "grad")
        case[f"grad_max_{step}"] = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        n_ref = clip_grad_norm(ref.parameters(), max_norm=0.05)  # small enough to clip
        n = clip_grad_norm(model.parameters(), max_norm=0.05)
        case[f"norm_{step}"] = [n, n_ref]
        case[f"clipped_grad_diff_{step}"] = maxdiff(model, ref, "grad")
        if use_muon:
            # bf16 Newton-Schulz turns the ~1e-7 gradient differences of the sharded reduction into bf16 rounding
            # flips (chaotic in the small singular directions), so the optimizer is compared on identical inputs:
            # the reference takes the sharded run's (clipped) gradients; the whole update must then be bitwise.
            with torch.no_grad():
                for (_, p), q in zip(ref.named_parameters(), model.parameters()):
                    if q.grad is not None:
                        p.grad.copy_(full(q.grad))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        case[f"param_diff_{step}"] = maxdiff(model, ref, "param")
        case[f"param_moved_{step}"] = max(float((a - b).abs().max()) for a, b in
                                          zip(ref.parameters(), tiny_transformer().parameters()))
    return case


res["adamw"] = train_case(use_muon=False)
res["muon"] = train_case(use_muon=True)


# ShardedMuon alone, given exactly the same gradients: bitwise equal to torch.optim.Muon, including uneven row
# shards (7 rows -> 4 + 3), an empty shard (1 row -> 1 + 0), tall (rows > cols) and wide matrices, HSDP placements.
def muon_exact(mesh_info):
    torch.manual_seed(1)
    shapes = [(7, 5), (1, 3), (64, 16), (16, 64), (6, 6)]
    ref = [nn.Parameter(torch.randn(*s)) for s in shapes]
    mesh = mesh_info.fsdp_mesh
    placements = [Shard(0)] if mesh.ndim == 1 else [torch.distributed.tensor.Replicate(), Shard(0)]
    sh = [nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements)) for p in ref]
    o_ref = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    o = ShardedMuon(sh, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    equal = True
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        grads = [torch.randn(*s, generator=g) for s in shapes]
        for p, q, gr in zip(ref, sh, grads):
            p.grad = gr.clone()
            q.grad = distribute_tensor(gr.clone(), mesh, placements)
        o_ref.step()
        o.step()
        equal &= all(torch.equal(full(q).detach(), p.detach()) for p, q in zip(ref, sh))
    # the state dict is torch's: momentum_buffer per parameter
    equal &= all(torch.equal(full(o.state[q]["momentum_buffer"]), o_ref.state[p]["momentum_buffer"])
                 for p, q in zip(ref, sh))
    return equal


res["muon_exact_fsdp"] = muon_exact(info)
def layout(sp, dp_replicate):
    mesh, dp_mesh, fsdp_mesh = build_mesh("cpu", world, sp, dp_replicate)
    return DistInfo(rank=rank, world_size=world, sp_size=sp, dp_replicate=dp_replicate, mesh=mesh, dp_mesh=dp_mesh,
                    fsdp_mesh=fsdp_mesh)


hsdp = layout(1, 2)
res["muon_exact_hsdp"] = muon_exact(hsdp)


# The gradient divide factor: each rank contributes a known partial gradient x_r; the wanted gradient is the sum
# over sp peers and the mean over dp ranks.
class Stand(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer_blocks = nn.ModuleList([nn.Linear(4, 2, bias=False)])
        self.proj_out = nn.Linear(2, 2, bias=False)

    def forward(self, x):
        return self.proj_out(self.transformer_blocks[0](x))


def divide_case(sp, dp_replicate):
    lay = layout(sp, dp_replicate)
    torch.manual_seed(0)
    m = Stand()
    w0 = m.transformer_blocks[0].weight.detach().clone()
    shard_modules(m, m.transformer_blocks, lay)
    xs = [torch.tensor([[1.0, 2.0, 3.0, 4.0]]) * (r + 1) for r in range(world)]
    # loss linear in the block's output: d loss / d W = ones(2, 1) @ x_r (partial gradient of rank r)
    (m.transformer_blocks[0](xs[rank])).sum().backward()
    got = full(m.transformer_blocks[0].weight.grad)
    partial = [torch.ones(2, 1) @ x for x in xs]
    dp = world // sp
    want = sum(partial) / dp  # sum over all ranks, divided by dp only (sp partials add)
    unchanged = bool(torch.equal(full(m.transformer_blocks[0].weight), w0))
    return float((got - want).abs().max()), float(want.abs().max()), unchanged


res["divide"] = {f"sp{sp}_R{r}": divide_case(sp, r) for sp, r in ((1, 1), (2, 1), (1, 2))}

(out_dir / f"rank{rank}.json").write_text(json.dumps(res))
dist.barrier()
dist.destroy_process_group()
