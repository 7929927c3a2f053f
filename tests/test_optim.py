"""sage_grpo.optim: Muon/AdamW split, torch Muon against an independent Newton-Schulz, warm-up, clipping, exact state
round-trips and a bitwise DCP resume."""

from __future__ import annotations

import copy
import dataclasses
import io
import math

import pytest
import torch
from torch import nn

from sage_grpo.config import OptimConfig
from sage_grpo.errors import SageGRPOError
from sage_grpo.optim import (
    build_optimizer,
    clip_grad_norm,
    goes_to_muon,
    lr_at,
    optimizer_settings,
    split_muon_params,
)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (kellerjordan.github.io/posts/muon)


def cfg(lr=1e-2, wd=0.1, use_muon=True, **kw):
    """The run's optimizer settings (OptimConfig's defaults: the authors' AdamW betas) with these overrides."""
    return dataclasses.replace(OptimConfig(), learning_rate=lr, weight_decay=wd, use_muon=use_muon, **kw)


def tiny_transformer(seed=0):
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.tiny import tiny_transformer_config

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(**tiny_transformer_config())


def tiny_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 9, 2, 4, 4, generator=g),
        timestep=torch.tensor([300.0 + 100 * seed]),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
        encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]),
        encoder_hidden_states_2=torch.randn(1, 4, 16, generator=g),
        encoder_attention_mask_2=torch.tensor([[1, 1, 0, 0]]),
        image_embeds=torch.zeros(1, 4, 16),
        return_dict=False,
    )


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.unused = nn.Linear(d, d)  # never gets a gradient, like the last block's to_add_out

    def forward(self, x):
        return x + self.ff(self.attn(self.norm(x)))


class Toy(nn.Module):
    """Named like HunyuanVideo-1.5: a 5-D patch embedding, transformer_blocks, norm_out / proj_out."""

    def __init__(self, d=8):
        super().__init__()
        self.x_embedder = nn.Conv3d(3, d, 1)
        self.transformer_blocks = nn.ModuleList([Block(d), Block(d)])
        self.norm_out = nn.LayerNorm(d)
        self.proj_out = nn.Linear(d, 2)

    def forward(self, x):  # x: [B, 3, T, H, W]
        h = self.x_embedder(x).flatten(2).transpose(1, 2)
        for blk in self.transformer_blocks:
            h = blk(h)
        return self.proj_out(self.norm_out(h))


def toy_step(model, opt, seed, update, peak=1e-2, warmup=3, max_norm=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 1, 2, 2, generator=g)
    model(x).square().mean().backward()
    norm = clip_grad_norm(model.parameters(), max_norm)
    opt.set_lr(lr_at(update, peak, warmup))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def assert_state_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    else:
        assert a == b


# --- the split ---------------------------------------------------------------------------------------------------


def test_split_full_finetune_tiny_transformer():
    model = tiny_transformer()
    named = list(model.named_parameters())
    muon, adamw = split_muon_params(named)
    m, a = {n for n, _ in muon}, {n for n, _ in adamw}
    assert m | a == {n for n, _ in named} and not m & a
    assert all(p.ndim == 2 for _, p in muon)
    expect = {
        n for n, p in named
        if p.ndim == 2
        and (n.startswith("transformer_blocks.") or n.startswith("context_embedder.token_refiner.refiner_blocks."))
    }
    assert m == expect
    assert "transformer_blocks.0.attn.to_q.weight" in m and "transformer_blocks.0.norm1.linear.weight" in m
    assert "context_embedder.token_refiner.refiner_blocks.0.attn.to_q.weight" in m
    for name in ("x_embedder.proj.weight", "proj_out.weight", "norm_out.linear.weight", "cond_type_embed.weight",
                 "context_embedder_2.linear_2.weight", "time_embed.timestep_embedder.linear_1.weight",
                 "context_embedder.proj_in.weight", "image_embedder.linear_1.weight",
                 "transformer_blocks.0.attn.to_q.bias", "transformer_blocks.0.attn.norm_q.weight"):
        assert name in a, name
    assert model.get_parameter("x_embedder.proj.weight").ndim == 5
    opt = build_optimizer(named, cfg())
    assert opt.names == ["muon", "adamw"]
    assert isinstance(opt["muon"], torch.optim.Muon) and isinstance(opt["adamw"], torch.optim.AdamW)
    assert opt["muon"].param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert {id(p) for p in opt["muon"].param_groups[0]["params"]} == {id(p) for _, p in muon}
    assert len(opt.params()) == len(named)


def test_split_lora_tiny_transformer():
    pytest.importorskip("peft")
    from sage_grpo.models.lora import setup_trainable

    model = tiny_transformer()
    trainable = setup_trainable(model, use_lora=True, lora_r=4, lora_alpha=8)
    named = list(model.named_parameters())
    muon, adamw = split_muon_params(named)
    assert {id(p) for _, p in muon} == {id(p) for p in trainable}  # every adapter matrix, nothing frozen
    assert adamw == []
    assert all(("lora_A" in n or "lora_B" in n) and p.ndim == 2 for n, p in muon)
    assert any(".lora_A." in n for n, _ in muon) and any(".lora_B." in n for n, _ in muon)
    opt = build_optimizer(named, cfg())
    assert opt.names == ["muon"]
    assert not opt.optimizers[0].state.keys() - {p for _, p in muon}
    # AdamW only: the same adapters, nothing else.
    opt = build_optimizer(model.named_parameters(), cfg(use_muon=False))
    assert opt.names == ["adamw"] and {id(p) for p in opt.params()} == {id(p) for p in trainable}


def test_bad_params_never_reach_muon():
    p2, p3, p5, p1 = (nn.Parameter(torch.randn(*s)) for s in ((4, 4), (2, 4, 4), (4, 3, 1, 1, 1), (4,)))
    named = [
        ("transformer_blocks.0.attn.to_q.weight", p2),
        ("transformer_blocks.0.attn.packed", p3),  # 3-D inside a block
        ("transformer_blocks.0.conv.weight", p5),  # Conv3d kernel inside a block
        ("transformer_blocks.0.attn.to_q.bias", p1),
        ("proj_out.weight", nn.Parameter(torch.randn(4, 4))),  # 2-D, output layer
        ("x_embedder.proj.weight", nn.Parameter(torch.randn(4, 3, 1, 2, 2))),
        ("my_transformer_blocks.0.w", nn.Parameter(torch.randn(4, 4))),  # not the blocks
    ]
    muon, adamw = split_muon_params(named)
    assert [n for n, _ in muon] == ["transformer_blocks.0.attn.to_q.weight"]
    assert len(adamw) == 6
    opt = build_optimizer(named, cfg())  # torch.optim.Muon would raise on a non-2-D parameter
    assert all(p.ndim == 2 for p in opt["muon"].param_groups[0]["params"])
    # Wrapper prefixes (torch.compile, activation checkpointing, FSDP1, DDP) do not hide the blocks.
    w = torch.zeros(4, 4)
    for name in ("_orig_mod.transformer_blocks.3.attn.to_k.weight",
                 "module.transformer_blocks.0._checkpoint_wrapped_module.ff.net.2.weight",
                 "_fsdp_wrapped_module.transformer_blocks.1.attn.to_v.weight",
                 "transformer.transformer_blocks.0.attn.to_q.lora_B.default.weight"):
        assert goes_to_muon(name, w), name
    assert not goes_to_muon("transformer_blocks.0.attn.lora_magnitude_vector.default.weight", torch.zeros(4))
    frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    assert split_muon_params([("transformer_blocks.0.a.weight", frozen)]) == ([], [])
    with pytest.raises(SageGRPOError):
        build_optimizer([("transformer_blocks.0.a.weight", frozen)], cfg())


# --- Muon against an independent Newton-Schulz -------------------------------------------------------------------


def _bf16(x):
    return x.bfloat16().float()


def newton_schulz_bf16(g, steps=5, eps=1e-7):
    """Quintic Newton-Schulz with bf16 storage (torch's Muon casts to bf16): fp32 arithmetic, rounded to bf16 where
    a bf16 implementation stores a result (normalised input, Gram matrix, polynomial, iterate)."""
    a, b, c = NS_COEFFICIENTS
    x = _bf16(g)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = _bf16(x / _bf16(x.double().norm().float()).clamp(min=eps))
    for _ in range(steps):
        gram = _bf16(x @ x.T)
        poly = _bf16(b * gram + c * (gram @ gram))
        x = _bf16(a * x + poly @ x)
    return x.T if tall else x


def newton_schulz_f64(g, steps=5):
    a, b, c = NS_COEFFICIENTS
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(48, 32), (24, 40)])
def test_muon_update_is_newton_schulz_with_match_rms_adamw(shape):
    torch.manual_seed(0)
    lr, wd, mu = 0.02, 0.1, 0.95
    named = [("transformer_blocks.0.attn.to_q.weight", nn.Parameter(torch.randn(*shape)))]
    p = named[0][1]
    opt = build_optimizer(named, cfg(lr=lr, wd=wd))
    assert opt.names == ["muon"]
    scale = lr * 0.2 * math.sqrt(max(shape))  # match_rms_adamw
    buf = torch.zeros(shape)
    for _ in range(3):
        g = torch.randn(shape)
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        buf = buf.lerp(g, 1 - mu)  # momentum (EMA form), Nesterov look-ahead
        update = g.lerp(buf, mu)
        ortho = newton_schulz_bf16(update)
        expect = before * (1 - lr * wd) - scale * ortho
        # In units of the orthogonalised update. Often equal to fp32 rounding; but the bf16 matmuls accumulate in
        # another order than this fp32 emulation, and a single bf16 rounding flip in an early iteration spreads
        # through the later ones, so allow a few bf16 ulps (2^-8 at 1.0) per entry and 2% in norm.
        diff = (p.detach() - expect) / scale
        assert diff.abs().max().item() <= 2.0**-6
        assert diff.norm().item() <= 0.02 * ortho.norm().item()
        # The same update in float64 (no bf16 rounding): the orthogonaliser itself, to bf16 accuracy.
        ortho64 = newton_schulz_f64(update).float()
        assert (ortho - ortho64).norm() / ortho64.norm() < 0.05
        sv = torch.linalg.svdvals(ortho64.double())
        assert sv.min() > 0.5 and sv.max() < 1.3  # the quintic's band around 1, not UV^T exactly
        p.grad = None


def test_match_rms_adamw_scaling_is_exact():
    """Same gradients, torch's default scaling sqrt(max(1, A/B)) vs ours 0.2 * sqrt(max(A, B)): the two updates
    differ by exactly that ratio (the Newton-Schulz output is the same computation in both)."""
    for shape in ((48, 32), (24, 40)):
        torch.manual_seed(1)
        w = torch.randn(*shape)
        ours, plain = nn.Parameter(w.clone()), nn.Parameter(w.clone())
        opt = build_optimizer([("transformer_blocks.0.ff.net.2.weight", ours)], cfg(lr=0.01, wd=0.0))
        ref = torch.optim.Muon([plain], lr=0.01, weight_decay=0.0)
        for _ in range(2):
            g = torch.randn(*shape)
            ours.grad, plain.grad = g.clone(), g.clone()
            before = ours.detach().clone()
            opt.step()
            ref.step()
            ratio = 0.2 * math.sqrt(max(shape)) / math.sqrt(max(1.0, shape[0] / shape[1]))
            torch.testing.assert_close(ours.detach() - before, ratio * (plain.detach() - before), rtol=1e-5, atol=1e-6)
            plain.data.copy_(ours.data)


def test_adamw_only_matches_plain_adamw():
    torch.manual_seed(0)
    a, b = Toy(), Toy()
    b.load_state_dict(a.state_dict())
    opt = build_optimizer(a.named_parameters(), cfg(use_muon=False))
    assert opt.names == ["adamw"] and len(opt.params()) == len(list(a.parameters()))
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.95, 0.95), eps=1e-8)
    for _ in range(3):
        x = torch.randn(2, 3, 1, 2, 2)
        for model, o in ((a, opt), (b, ref)):
            model(x).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_adamw_takes_the_authors_betas_and_the_flags():
    """Default AdamW = the authors' betas (0.95, 0.95), eps 1e-8: two steps against the update written out."""
    p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = build_optimizer([("proj_out.weight", p)], cfg(lr=0.1, wd=0.01, use_muon=False))
    assert opt["adamw"].param_groups[0]["betas"] == (0.95, 0.95) and opt["adamw"].param_groups[0]["eps"] == 1e-8
    b1 = b2 = 0.95
    x, m, v = p.detach().clone().double(), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for k, g in enumerate((torch.tensor([0.3, -1.0, 2.0]), torch.tensor([-0.5, 0.2, 1.0])), start=1):
        p.grad = g.clone()
        opt.step()
        m, v = b1 * m + (1 - b1) * g.double(), b2 * v + (1 - b2) * g.double() ** 2
        x = x * (1 - 0.1 * 0.01) - 0.1 * (m / (1 - b1**k)) / ((v / (1 - b2**k)).sqrt() + 1e-8)
        torch.testing.assert_close(p.detach().double(), x, rtol=1e-6, atol=1e-7)
    custom = build_optimizer([("proj_out.weight", nn.Parameter(torch.zeros(2)))],
                             cfg(use_muon=False, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-6))
    assert custom["adamw"].param_groups[0]["betas"] == (0.9, 0.999) and custom["adamw"].param_groups[0]["eps"] == 1e-6


# --- learning rate -----------------------------------------------------------------------------------------------


def test_lr_at_warmup_then_constant():
    assert [lr_at(u, 1.0, 4) for u in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert [lr_at(u, 2e-5, 0) for u in range(3)] == [2e-5] * 3  # no warm-up: the authors' constant lr
    assert lr_at(0, 1e-5, 1) == 1e-5
    assert lr_at(10**6, 3e-4, 100) == 3e-4
    with pytest.raises(ValueError):
        lr_at(-1, 1.0, 4)


def test_warmup_scales_muon_and_adamw_updates():
    peak, warmup = 1e-2, 4
    torch.manual_seed(0)
    base = Toy()
    deltas = []
    for update in (0, 1, warmup):
        model = copy.deepcopy(base)
        opt = build_optimizer(model.named_parameters(), cfg(lr=peak, wd=0.0))
        model(torch.randn(2, 3, 1, 2, 2, generator=torch.Generator().manual_seed(1))).square().mean().backward()
        opt.set_lr(lr_at(update, peak, warmup))
        assert all(g["lr"] == lr_at(update, peak, warmup) for g in opt.param_groups) and len(opt.param_groups) == 2
        opt.step()
        deltas.append({n: (p - base.get_parameter(n)).detach() for n, p in model.named_parameters()})
    muon_names = {n for n, _ in split_muon_params(base.named_parameters())[0]}
    for n in deltas[0]:
        if deltas[2][n].abs().max() == 0:
            continue  # no gradient (the unused layers)
        for i, frac in ((0, 0.25), (1, 0.5)):
            # atol: the rounding of p_new - p_old
            torch.testing.assert_close(deltas[i][n], frac * deltas[2][n], rtol=1e-5, atol=1e-7)
    assert muon_names and any(deltas[2][n].abs().max() > 0 for n in muon_names)


# --- clipping ------------------------------------------------------------------------------------------------------


def test_clip_grad_norm():
    ps = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(1))]
    ps[0].grad, ps[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])  # ps[2]: no grad
    assert clip_grad_norm(ps, 0.0) == pytest.approx(5.0)  # measure only
    assert torch.equal(ps[0].grad, torch.tensor([3.0, 0.0, 0.0]))
    assert clip_grad_norm(ps, 10.0) == pytest.approx(5.0)  # below the limit: unchanged
    assert torch.equal(ps[1].grad, torch.tensor([[0.0, 4.0], [0.0, 0.0]]))
    assert clip_grad_norm(ps, 1.0) == pytest.approx(5.0)  # returns the norm before clipping
    total = torch.cat([p.grad.flatten() for p in ps[:2]]).norm().item()
    assert total == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm(ps, -1.0) == pytest.approx(1.0, rel=1e-5)
    ps[0].grad[0] = float("inf")
    assert clip_grad_norm(ps, 1.0) == float("inf")
    assert ps[0].grad[0] == float("inf") and ps[1].grad[0, 1] == pytest.approx(0.8)  # left alone
    assert clip_grad_norm([nn.Parameter(torch.zeros(2))], 1.0) == 0.0


# --- state round trips and resume --------------------------------------------------------------------------------


def test_materialize_state_is_neutral():
    torch.manual_seed(0)
    a = Toy()
    b = copy.deepcopy(a)
    oa = build_optimizer(a.named_parameters(), cfg())
    ob = build_optimizer(b.named_parameters(), cfg(), materialize=False)
    # Every parameter has state before the first update, including those that never get a gradient.
    assert all(p in oa["muon"].state or p in oa["adamw"].state for p in a.parameters())
    assert all(float(s["step"]) == 0 for s in oa["adamw"].state.values())
    assert all(not s["momentum_buffer"].any() for s in oa["muon"].state.values())
    assert not ob["muon"].state and not ob["adamw"].state
    for u in range(3):
        assert toy_step(a, oa, u, u) == toy_step(b, ob, u, u)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert all(float(oa["adamw"].state[p]["step"]) == 3 for p in a.x_embedder.parameters())
    unused = a.transformer_blocks[0].unused
    assert float(oa["adamw"].state[unused.bias]["step"]) == 0  # never stepped: still the fresh state
    a.proj_out.bias.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="gradients"):
        oa.materialize_state()  # a live gradient would enter the moments


def test_state_dict_round_trip_and_exact_continuation():
    torch.manual_seed(0)
    a = Toy()
    oa = build_optimizer(a.named_parameters(), cfg())
    for u in range(2):
        toy_step(a, oa, u, u)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    torch.manual_seed(123)
    b = Toy()  # different init: everything must come from the checkpoint
    b.load_state_dict(saved["model"])
    ob = build_optimizer(b.named_parameters(), cfg())
    ob.load_state_dict(saved["optim"])
    assert_state_equal(ob.state_dict(), oa.state_dict())
    for u in range(2, 4):
        assert toy_step(a, oa, u, u) == toy_step(b, ob, u, u)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert_state_equal(ob.state_dict(), oa.state_dict())
    with pytest.raises(SageGRPOError, match="use_muon"):
        build_optimizer(b.named_parameters(), cfg(use_muon=False)).load_state_dict(saved["optim"])


def test_apply_settings_replaces_the_hyper_parameters_a_load_brings_back():
    """A state dict holds the saved run's weight decay, betas and eps, and loading it restores them over the ones
    the optimizer was built with; apply_settings gives every group of Muon and AdamW this run's again and keeps the
    rest of what was loaded (moments, step counters, the learning rate of the schedule, torch's own flags)."""
    torch.manual_seed(0)
    a = Toy()
    oa = build_optimizer(a.named_parameters(), cfg())
    for u in range(2):
        toy_step(a, oa, u, u)
    saved = copy.deepcopy(oa.state_dict())
    new = cfg(wd=0.5, adam_beta1=0.5, adam_beta2=0.9, adam_eps=1e-3)
    ob = build_optimizer(copy.deepcopy(a).named_parameters(), new)
    ob.load_state_dict(saved)
    assert ob["adamw"].param_groups[0]["weight_decay"] == 0.1  # the saved run's: what a resume trained with
    ob.apply_settings(optimizer_settings(new))
    assert ob.names == ["muon", "adamw"]
    for g in ob["muon"].param_groups:
        assert (g["weight_decay"], g["adjust_lr_fn"]) == (0.5, "match_rms_adamw")
    for g in ob["adamw"].param_groups:
        assert (g["weight_decay"], g["betas"], g["eps"]) == (0.5, (0.5, 0.9), 1e-3)
    got = ob.state_dict()
    for name in ob.names:
        assert_state_equal(got[name]["state"], saved[name]["state"])
        for g, h in zip(got[name]["param_groups"], saved[name]["param_groups"]):
            changed = set(optimizer_settings(new)[name])
            assert {k: v for k, v in g.items() if k not in changed} == {k: v for k, v in h.items() if k not in changed}
    # the settings a run is built with are the ones applied: one source
    fresh = build_optimizer(Toy().named_parameters(), new)
    for name in fresh.names:
        assert all(g.items() >= optimizer_settings(new)[name].items() for g in fresh[name].param_groups)


def _hv_train(model, opt, updates, peak=5e-3, warmup=3):
    model.train()
    for u in updates:
        out = model(**tiny_inputs(u))[0]
        out.square().mean().backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.set_lr(lr_at(u, peak, warmup))
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group: one process
def test_dcp_resume_is_bitwise(tmp_path):
    """Uninterrupted 4 updates == 2 updates, torch.distributed.checkpoint save, fresh model + optimizers, load, 2
    more: one process, no process group, the list of two optimizers through get/set_optimizer_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    ref = tiny_transformer(seed=0)
    ref_opt = build_optimizer(ref.named_parameters(), cfg(lr=5e-3, wd=0.01))
    _hv_train(ref, ref_opt, range(4))

    run = tiny_transformer(seed=0)
    opt = build_optimizer(run.named_parameters(), cfg(lr=5e-3, wd=0.01))
    assert opt.names == ["muon", "adamw"]
    _hv_train(run, opt, range(2))
    state = {"model": get_model_state_dict(run), "optimizer": get_optimizer_state_dict(run, opt.optimizers)}
    # Parameters that never get a gradient (last block's to_add_out / ff_context) are in the checkpoint too.
    assert "transformer_blocks.0.attn.to_add_out.weight" in state["optimizer"]["state"]
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))

    resumed = tiny_transformer(seed=7)  # different init
    ropt = build_optimizer(resumed.named_parameters(), cfg(lr=5e-3, wd=0.01))
    target = {
        "model": get_model_state_dict(resumed),
        "optimizer": get_optimizer_state_dict(resumed, ropt.optimizers),
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    set_model_state_dict(resumed, target["model"])
    set_optimizer_state_dict(resumed, ropt.optimizers, target["optimizer"])
    assert_state_equal(ropt.state_dict(), opt.state_dict())
    _hv_train(resumed, ropt, range(2, 4))

    for (n, pr), (_, pq) in zip(ref.named_parameters(), resumed.named_parameters()):
        assert torch.equal(pr, pq), n
    assert_state_equal(ropt.state_dict(), ref_opt.state_dict())
    assert not torch.equal(ref.proj_out.weight, tiny_transformer(seed=0).proj_out.weight)  # it did train
