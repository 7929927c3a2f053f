"""The rollout loop: parity with HunyuanVideo15Pipeline.__call__, reproducibility, seeding, re-scoring (ratio 1),
CFG layout, decoding."""

import pytest
import torch
from helpers import TINY_FRAMES, TINY_H, TINY_W

from sage_grpo.rollout import (
    INIT_NOISE_STEP,
    SamplerSettings,
    decode_latents,
    derive_seed,
    latent_shape,
    policy_step,
    predict_velocity,
    rollout,
)
from sage_grpo.schedule import sigma_schedule

PROMPTS = ["a red ball rolls", 'a sign that says "hi"']


def _run(pipe, cache, settings, prompts=PROMPTS, gens=None, seeds=None, size=(TINY_FRAMES, TINY_H, TINY_W), **kw):
    n = len(prompts)
    gens = torch.zeros(n, dtype=torch.long) if gens is None else gens
    seeds = torch.tensor([7 + i for i in range(n)]) if seeds is None else seeds
    return rollout(
        pipe.transformer, cache.get(prompts), cache.get([""]), prompts=prompts, prompt_ids=torch.arange(n),
        generation_ids=gens, prompt_seeds=seeds, latent_shape=latent_shape(pipe.vae.config, *size),
        settings=settings, image_tokens=pipe.vision_num_semantic_tokens, base_seed=3, **kw,
    )


def test_ode_rollout_matches_diffusers_pipeline(tiny_pipe, text_cache):
    steps, (f, h, w) = 4, (5, 16, 24)  # small: the pipeline and its decode run twice more below
    settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=steps, shift=5.0, cfg_scale=6.0)
    traj = _run(tiny_pipe, text_cache, settings, size=(f, h, w))
    seeds = [derive_seed(3, 7 + i, 0, INIT_NOISE_STEP) for i in range(2)]
    assert tiny_pipe.scheduler.config.shift == 5.0 and tiny_pipe.guider.guidance_scale == 6.0
    kw = dict(prompt=PROMPTS, negative_prompt=["", ""], height=h, width=w, num_frames=f,
              num_inference_steps=steps)
    ref = tiny_pipe(generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="latent", **kw).frames
    assert ref.shape == traj.final_latents.shape and ref.abs().mean() > 0.1
    assert (ref - traj.final_latents).abs().max().item() < 1e-5
    # The pipeline's own noise is what our seeds draw: x_0 agrees exactly.
    x0 = torch.stack([torch.randn(traj.latents.shape[2:], generator=torch.Generator().manual_seed(s)) for s in seeds])
    assert torch.equal(traj.latents[:, 0], x0)
    tiny_pipe.vae.enable_slicing()  # the pipeline decodes the batch at once: diffusers' VAE batch bug
    try:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        ref_frames = tiny_pipe(generator=generators, output_type="pt", **kw).frames
    finally:
        tiny_pipe.vae.disable_slicing()
    frames = decode_latents(tiny_pipe.vae, traj.final_latents)
    assert frames.shape == ref_frames.shape == (2, f, 3, h, w)
    assert (frames - ref_frames).abs().max().item() < 1e-4


def test_rollout_is_reproducible_and_batch_independent(tiny_pipe, text_cache):
    s = SamplerSettings(sde_type="sage_grpo", eta=0.5, num_steps=2, cfg_scale=6.0)
    a = _run(tiny_pipe, text_cache, s)
    b = _run(tiny_pipe, text_cache, s)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert a.latents.shape == (2, 3, 4, 3, 8, 12) and a.log_probs.shape == (2, 2)
    # Sample 1 alone draws the same noise as in the batch (generators are per sample, not per batch).
    alone = _run(tiny_pipe, text_cache, s, prompts=PROMPTS[1:], seeds=torch.tensor([8]))
    assert torch.equal(alone.latents[0, 0], a.latents[1, 0])
    assert (alone.latents[0, -1].float() - a.latents[1, -1].float()).abs().max() < 1e-5
    other = _run(tiny_pipe, text_cache, s, seeds=torch.tensor([100, 101]))
    assert not torch.equal(other.latents[:, 0], a.latents[:, 0])


def test_same_noise_shares_only_the_initial_noise(tiny_pipe, text_cache):
    s = SamplerSettings(sde_type="flow_grpo", eta=0.7, num_steps=2, cfg_scale=1.0)
    group = [PROMPTS[0]] * 3
    kw = dict(prompts=group, gens=torch.arange(3), seeds=torch.tensor([5, 5, 5]))
    same = _run(tiny_pipe, text_cache, s, same_noise=True, **kw)
    diff = _run(tiny_pipe, text_cache, s, same_noise=False, **kw)
    assert torch.equal(same.latents[0, 0], same.latents[1, 0]) and torch.equal(same.latents[0, 0], same.latents[2, 0])
    assert not torch.equal(same.latents[0, 1], same.latents[1, 1])  # SDE noise still per sample
    assert not torch.equal(diff.latents[0, 0], diff.latents[1, 0])


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sde_type", ["sage_grpo", "cps", "flow_grpo", "dance_grpo"])
def test_rescoring_stored_samples_gives_ratio_one(tiny_pipe, text_cache, storage, sde_type):
    s = SamplerSettings(sde_type=sde_type, eta=0.5, num_steps=3, cfg_scale=6.0)
    traj = _run(tiny_pipe, text_cache, s, storage_dtype=storage)
    assert traj.latents.dtype == storage
    # finite everywhere (a NaN compares unequal to everything, so the equalities below alone would not say so),
    # and every SDE step but cps' deterministic last one injects noise: a real log-density, not the 0 of V_t = 0
    assert torch.isfinite(traj.latents.float()).all() and torch.isfinite(traj.log_probs).all()
    noisy = traj.log_probs[:, :-1] if sde_type == "cps" else traj.log_probs
    assert (noisy != 0).all()
    for step in range(3):
        out = policy_step(tiny_pipe.transformer, traj, torch.arange(2), step, tiny_pipe.vision_num_semantic_tokens)
        ratio = torch.exp(out.log_prob - traj.log_probs[:, step])
        assert torch.equal(ratio, torch.ones_like(ratio)), (step, ratio)
        assert torch.equal(out.prev_sample, traj.latents[:, step + 1])


def test_sde_noise_differs_between_the_steps_of_a_trajectory(tiny_pipe, text_cache):
    # Recover each step's standard-normal draw xi_t = (x_{t+1} - mean_t) / std_t from the stored trajectory: the
    # draws of one sample at different steps must be independent (the step index is part of the noise seed).
    s = SamplerSettings(sde_type="sage_grpo", eta=0.5, num_steps=3, cfg_scale=6.0)
    traj = _run(tiny_pipe, text_cache, s)
    xi = []
    for step in range(3):
        out = policy_step(tiny_pipe.transformer, traj, torch.arange(2), step, tiny_pipe.vision_num_semantic_tokens)
        x_next = traj.latents[:, step + 1].double()
        xi.append(((x_next - out.mean.double()) / out.std.double().view(-1, 1, 1, 1, 1)).reshape(2, -1))
    n = xi[0].shape[1]  # 1152 elements per sample: a correlation of independent draws is ~ 1 / sqrt(n) = 0.03
    for b in range(2):
        for a in range(3):
            assert xi[a][b].std().item() == pytest.approx(1.0, abs=0.1)  # really the standard-normal draw
            for c in range(a + 1, 3):
                corr = torch.corrcoef(torch.stack([xi[a][b], xi[c][b]]))[0, 1].item()
                assert abs(corr) < 6 / n**0.5, (b, a, c, corr)
    assert abs(torch.corrcoef(torch.stack([xi[0][0], xi[0][1]]))[0, 1].item()) < 6 / n**0.5  # and between samples


def test_rescoring_subsets_and_gradients(tiny_pipe, text_cache):
    s = SamplerSettings(sde_type="sage_grpo", eta=0.5, num_steps=2, cfg_scale=6.0)
    traj = _run(tiny_pipe, text_cache, s)
    # A single sample at a per-sample step (the update's micro-batch) re-scores to float rounding.
    out = policy_step(tiny_pipe.transformer, traj, [1], torch.tensor([1]), tiny_pipe.vision_num_semantic_tokens)
    assert (out.log_prob - traj.log_probs[1, 1]).abs().item() < 1e-5
    tr = tiny_pipe.transformer
    w = tr.proj_out.weight
    w.requires_grad_(True)
    try:
        with torch.enable_grad():
            out = policy_step(tr, traj, [0, 1], 0, tiny_pipe.vision_num_semantic_tokens)
            out.log_prob.sum().backward()
        assert w.grad is not None and w.grad.abs().sum() > 0
    finally:
        w.grad = None
        w.requires_grad_(False)


def test_cfg_layout_and_cfg_off(tiny_pipe, text_cache):
    shape = (2, *latent_shape(tiny_pipe.vae.config, TINY_FRAMES, TINY_H, TINY_W))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.5], dtype=torch.float64)
    cond, unc = text_cache.get(PROMPTS), text_cache.get(["", ""])
    n = tiny_pipe.vision_num_semantic_tokens
    v_c = predict_velocity(tiny_pipe.transformer, x, sigma, cond, None, SamplerSettings(cfg_scale=1.0), n)
    v_u = predict_velocity(tiny_pipe.transformer, x, sigma, unc, None, SamplerSettings(cfg_scale=1.0), n)
    v = predict_velocity(tiny_pipe.transformer, x, sigma, cond, unc, SamplerSettings(cfg_scale=4.0), n)
    assert (v - (v_u + 4.0 * (v_c - v_u))).abs().max() < 1e-4
    # The conditional half is the same forward as the transformer called directly.
    direct = tiny_pipe.transformer(
        hidden_states=torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[:, :1])], 1),
        timestep=(sigma * 1000).float(),
        encoder_hidden_states=cond.prompt_embeds, encoder_attention_mask=cond.prompt_mask,
        encoder_hidden_states_2=cond.byt5_embeds, encoder_attention_mask_2=cond.byt5_mask,
        image_embeds=torch.zeros(2, n, tiny_pipe.transformer.config.image_embed_dim), return_dict=False)[0]
    assert torch.equal(direct, v_c)


def test_trajectory_fields(tiny_pipe, text_cache):
    s = SamplerSettings(sde_type="dance_grpo", eta=0.3, num_steps=4, shift=3.0, cfg_scale=6.0)
    traj = _run(tiny_pipe, text_cache, s)
    assert torch.equal(traj.sigmas, sigma_schedule(4, 3.0))
    assert torch.equal(traj.step_indices, torch.arange(4)) and traj.prompts == PROMPTS
    assert len(traj.cond) == 2 and len(traj.uncond) == 2 and traj.settings == s
    assert torch.isfinite(traj.log_probs).all()


def test_decode_divides_by_scaling_factor_once(tiny_pipe):
    z = torch.randn(2, 4, 2, 4, 6, generator=torch.Generator().manual_seed(1))
    frames = decode_latents(tiny_pipe.vae, z)
    with torch.no_grad():
        ref = tiny_pipe.vae.decode(z[1:] / tiny_pipe.vae.config.scaling_factor, return_dict=False)[0]
    expect = (ref / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
    assert torch.equal(frames[1:], expect)
    assert frames.min() >= 0 and frames.max() <= 1


def test_autocast_rollout_rescores_to_ratio_one_with_fp32_timesteps(tiny_pipe, text_cache):
    # fp32 master weights with bf16 autocast (--dtype bf16 --master_weight_type fp32): re-scoring goes through the
    # same autocast forward, and the transformer sees t = 1000 sigma in fp32 (bf16 would round 989.58 to 988).
    s = SamplerSettings(sde_type="sage_grpo", eta=0.5, num_steps=2, cfg_scale=6.0, compute_dtype=torch.bfloat16,
                        autocast=True)
    seen = []
    hook = tiny_pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]),
                                                           with_kwargs=True)
    try:
        traj = _run(tiny_pipe, text_cache, s, storage_dtype=torch.bfloat16)
        out = policy_step(tiny_pipe.transformer, traj, torch.arange(2), 1, tiny_pipe.vision_num_semantic_tokens)
    finally:
        hook.remove()
    assert all(t.dtype == torch.float32 for t in seen)
    torch.testing.assert_close(seen[1], (traj.sigmas[[1, 1, 1, 1]] * 1000).float())
    assert torch.equal(torch.exp(out.log_prob - traj.log_probs[:, 1]), torch.ones(2))


@pytest.mark.parametrize("sde_type", ["sage_grpo", "cps"])
def test_chunks_one_after_another_sample_exactly_what_steps_outermost_sample(tiny_pipe, text_cache, sde_type):
    """on_chunk (post_train scores a finished chunk while the next samples) changes the order, not the samples."""
    s = SamplerSettings(sde_type=sde_type, eta=0.5, num_steps=3, cfg_scale=6.0)
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    kw = dict(prompts=prompts, gens=torch.tensor([0, 1, 0, 1]), seeds=torch.tensor([7, 7, 8, 8]), chunk_size=2)
    done = []
    a = _run(tiny_pipe, text_cache, s, **kw)
    b = _run(tiny_pipe, text_cache, s, on_chunk=lambda c, x: done.append((c.tolist(), x.clone())), **kw)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert [c for c, _ in done] == [[0, 1], [2, 3]]
    assert all(torch.equal(x, a.final_latents[c]) for c, x in done)



def _world_tail_setup():
    """The tiny world model (a trained flow: a smooth enough ODE for a solver's order to show), two captions."""
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.world.pretrain import WORLD_MODEL_DIR

    pipe = load_pipeline("", WORLD_MODEL_DIR, dtype=torch.float32)
    return pipe, TextEmbeddingCache(pipe, "cpu", torch.float32)


def _tail_run(pipe, cache, solver, ode_steps, *, prompts, cfg_scale=1.0, num_steps=10, window=(0, 2), size=None):
    """An SDE window at the start, the ODE tail after it by `solver` in `ode_steps` steps (0 = the schedule's)."""
    from sage_grpo.window import window_mask

    s = SamplerSettings(sde_type="sage_grpo", eta=1.0, num_steps=num_steps, shift=5.0, cfg_scale=cfg_scale,
                        ode_solver=solver, ode_steps=ode_steps)
    return _run(pipe, cache, s, prompts=prompts, sde_steps=window_mask(num_steps, *window),
                **({"size": size} if size else {}))


@pytest.mark.slow
def test_unipc_tail_reaches_the_many_step_end_point_in_half_the_steps():
    """On the tiny world model (no CFG, as the recipes that use it), the ODE after a window [0, 2) of T 10 in 4 UniPC
    steps ends within 20 % of the schedule's 8 Euler steps' distance from a 200-step Euler reference (measured: 0.095
    against 0.083) and closer than 4 Euler steps on the same sigmas (0.135); the window's own steps are untouched."""
    from sage_grpo.rollout import ode_tail
    from sage_grpo.window import tail_sigmas

    pipe, cache = _world_tail_setup()
    prompts = ["a large red square moves right on a blue background", "a small green circle on a black background"]
    kw = dict(prompts=prompts, size=(9, 32, 32))
    full = _tail_run(pipe, cache, "euler", 0, **kw)  # the schedule's 8 Euler steps after [0, 2)
    x_hi = full.latents[:, 2]  # [B, C, F, H, W]: the window's end state, the same for every tail below

    def velocity(x, sigma, sigma_next):
        return predict_velocity(pipe.transformer, x, sigma.expand(x.shape[0]), cache.get(prompts), None,
                                full.settings, pipe.vision_num_semantic_tokens)

    with torch.no_grad():
        ref = ode_tail(velocity, x_hi, torch.linspace(float(full.sigmas[2]), 0.0, 201, dtype=torch.float64), "euler")
        euler4 = ode_tail(velocity, x_hi, tail_sigmas(full.sigmas, 2, 4), "euler")
    err = {"euler8": full.final_latents, "euler4": euler4}
    unipc = _tail_run(pipe, cache, "unipc", 4, **kw)
    assert torch.equal(unipc.latents[:, :3], full.latents[:, :3])  # the window is the same
    assert torch.isnan(unipc.log_probs[:, 2:]).all() and torch.isfinite(unipc.log_probs[:, :2]).all()
    assert (unipc.latents[:, 3:] == unipc.final_latents.unsqueeze(1)).all()  # the tail keeps its end point only
    err["unipc4"] = unipc.final_latents
    err = {k: float((v - ref).pow(2).mean().sqrt()) for k, v in err.items()}
    assert err["unipc4"] < 1.2 * err["euler8"], err
    assert err["unipc4"] < 0.8 * err["euler4"], err


def test_the_unipc_tail_is_diffusers_scheduler_on_the_tails_sigmas(tiny_pipe, text_cache):
    """ode_tail's UniPC equals UniPCMultistepScheduler driven by hand over the tail's sigmas (flow prediction), and
    the tail's sigmas run evenly from the window's end to 0."""
    from diffusers import UniPCMultistepScheduler

    from sage_grpo.window import tail_sigmas

    traj = _tail_run(tiny_pipe, text_cache, "unipc", 3, prompts=PROMPTS, cfg_scale=6.0)
    sig = tail_sigmas(traj.sigmas, 2, 3)
    assert torch.allclose(sig, torch.tensor([3, 2, 1, 0], dtype=sig.dtype) / 3 * traj.sigmas[2])
    assert torch.equal(tail_sigmas(traj.sigmas, 2, 8), traj.sigmas[2:])  # every schedule step: the schedule's own
    cond, uncond = text_cache.get(PROMPTS), text_cache.get([""]).index([0, 0])
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0)
    sched.set_timesteps(sigmas=sig[:-1].numpy())
    assert torch.allclose(sched.sigmas.double(), sig, atol=1e-7)  # given sigmas kept, a 0 appended
    x = traj.latents[:, 2].float()
    with torch.no_grad():
        for k in range(3):
            v = predict_velocity(tiny_pipe.transformer, x, sig[k].expand(2), cond, uncond, traj.settings,
                                 tiny_pipe.vision_num_semantic_tokens)
            x = sched.step(v, sched.timesteps[k], x, return_dict=False)[0]
    assert torch.allclose(x, traj.final_latents, atol=1e-6)


@pytest.mark.parametrize("solver", ["euler", "unipc"])
def test_a_chunked_tail_samples_what_the_whole_batch_samples(tiny_pipe, text_cache, solver):
    from sage_grpo.window import window_mask

    s = SamplerSettings(sde_type="sage_grpo", eta=0.5, num_steps=6, cfg_scale=6.0, ode_solver=solver, ode_steps=2)
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    kw = dict(prompts=prompts, gens=torch.tensor([0, 1, 0, 1]), seeds=torch.tensor([7, 7, 8, 8]), chunk_size=2,
              sde_steps=window_mask(6, 0, 2))
    a = _run(tiny_pipe, text_cache, s, **kw)
    b = _run(tiny_pipe, text_cache, s, on_chunk=lambda c, x: None, **kw)
    assert torch.equal(a.latents, b.latents)
    assert torch.equal(a.log_probs.nan_to_num(-1.0), b.log_probs.nan_to_num(-1.0))
