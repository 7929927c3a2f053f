"""The cheaper-steps recipes (docs/performance.md "Cheaper steps") and the transformer work a configuration needs.

A video GRPO step is dominated by transformer forwards: the rollout (T steps, two forwards each with CFG), the
re-scored trained pairs (forward + backward) and the anchor's forwards for the position KL. The recipes cut them
the peers' ways, each a set of post_train.py flags relative to the schedule's T steps:

  paper            every step SDE and trainable, CFG (the paper's recipe, the default)
  cfg_free         --cfg_scale 1: one forward per step instead of a CFG pair ("RL performs the CFG distillation")
  window           a fixed SDE window of T/4 steps at the start (the high-noise steps), ODE after it
  sliding          MixGRPO: a window of T/4 steps sliding by 1 every 2 updates, back to the start after the end
  sliding_shared   the sliding window from step 1 with one initial noise per group and the shared ODE prefix
  cfg_free_sliding cfg_free + sliding_shared
  cfg_free_sliding_unipc  cfg_free_sliding with the ODE after the window in ODE_TAIL_STEPS UniPC steps
                   (MixGRPO-Flash's higher-order solver, diffusers' UniPCMultistepScheduler on the schedule's sigmas)
  cfg_free_wide_unipc  cfg_free_sliding_unipc with a window of 2T/5 steps (4 of 10 on the world model, 8 of 20 at
                   the authors' T): more of the schedule explored and trained, still under a quarter of the paper's
                   FLOPs at the real size
  flash            cfg_free_sliding_unipc training one step of the window per sample, the same step for the G
                   samples of a group (Flash-GRPO's grouping: one timestep per group, 1 trained step a trajectory)

`minimum_forwards` is the least transformer work per step of a configuration, from the configuration alone; the
step benchmark (scripts/bench_step.py) checks the loop's counted forwards against it, and the learning-per-compute
table (scripts/video_ablation.py --recipes) reports it.
"""

from __future__ import annotations

__all__ = ["RECIPES", "RECIPE_FLOP_RATIOS", "ODE_TAIL_STEPS", "recipe_settings", "recipe_flags", "minimum_forwards",
           "forwards_per_sample_step", "step_flops", "real_size_flop_ratios"]

RECIPES = ("paper", "cfg_free", "window", "sliding", "sliding_shared", "cfg_free_sliding", "cfg_free_sliding_unipc",
           "cfg_free_wide_unipc", "flash")
SLIDE_EVERY = 2  # updates between two moves of the recipes' sliding window (short runs: MixGRPO moves every 25)
ODE_TAIL_STEPS = 4  # UniPC steps of the ODE after the window (tests/test_rollout.py: on the tiny world model, without
# CFG, 4 of them end within 15 % of the schedule's 8 Euler steps' distance from a 200-step reference)
# Model FLOPs per step against the paper's at the real size, `real_size_flop_ratios(Config())` (the defaults of
# sage_grpo.config: T 20, 2 videos a rank, CFG 6, full fine-tuning; 81x352x624, 256 text tokens; mean over 100
# steps). Kept as numbers so that --help can show them without building a Config; tests/test_recipes.py checks them
# against the computation.
RECIPE_FLOP_RATIOS = {"paper": 1.0, "cfg_free": 0.5, "window": 0.403, "sliding": 0.403, "sliding_shared": 0.365,
                      "cfg_free_sliding": 0.182, "cfg_free_sliding_unipc": 0.161, "cfg_free_wide_unipc": 0.232,
                      "flash": 0.082}


def recipe_settings(name: str, num_steps: int) -> dict:
    """The rollout settings of recipe `name` for a schedule of `num_steps` steps (post_train.py's rollout keys; the
    window is T/4 steps, at least 1, cfg_free_wide_unipc's 2T/5). Every recipe sets the window and the initial-noise
    keys, so a recipe means the same on any config (configs/tiny_world.yaml, for one, trains an SDE window from one
    noise per group; "paper" on it is still every step SDE from independent noise). The toy lab reads the same
    dict."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(RECIPES)}")
    size = max(1, num_steps // 4)
    paper = {"sde_window_start": 0, "sde_window_size": 0, "sde_window_stride": 0, "use_same_noise": False,
             "shared_prefix": False}
    sliding = {**paper, "sde_window_size": size, "sde_window_stride": 1, "sde_window_every": SLIDE_EVERY}
    shared = {**sliding, "sde_window_start": 1, "use_same_noise": True, "shared_prefix": True}
    solver = {"ode_solver": "euler", "ode_steps": 0, "timestep_fraction": 1.0, "group_timesteps": False}
    paper = {**paper, **solver}
    sliding = {**sliding, **solver}
    shared = {**shared, **solver}
    cfg_free_sliding = {**shared, "cfg_scale": 1.0}
    unipc = {**cfg_free_sliding, "ode_solver": "unipc", "ode_steps": ODE_TAIL_STEPS}
    return {
        "paper": paper,
        "cfg_free": {**paper, "cfg_scale": 1.0},
        "window": {**paper, "sde_window_size": size},
        "sliding": sliding,
        "sliding_shared": shared,
        "cfg_free_sliding": cfg_free_sliding,
        "cfg_free_sliding_unipc": unipc,
        "cfg_free_wide_unipc": {**unipc, "sde_window_size": max(1, 2 * num_steps // 5)},
        "flash": {**unipc, "timestep_fraction": 1.0 / size, "group_timesteps": True},
    }[name]


def recipe_flags(name: str, num_steps: int) -> list[str]:
    """post_train.py flags of recipe `name` for a schedule of `num_steps` steps."""
    return [item for key, value in recipe_settings(name, num_steps).items() for item in (f"--{key}", str(value))]


def minimum_forwards(cfg, steps: int) -> list[dict]:
    """The least transformer work each of `steps` steps can do, from the configuration alone (independent of the
    loop's own state): per-sample forwards by phase. With an SDE window the update trains int(T_w' x fraction) of
    the window's T_w' noisy steps; with a shared prefix the ODE steps before the window run once per prompt (P
    distinct prompts among the rank's b samples) instead of once per sample."""
    from sage_grpo.grpo import stochastic_steps
    from sage_grpo.kl import kl_term_weights
    from sage_grpo.schedule import num_train_timesteps, sigma_schedule
    from sage_grpo.sde import step_variance
    from sage_grpo.window import tail_steps, window_bounds

    r, o, k_cfg = cfg.rollout, cfg.optim, cfg.kl
    cfg_mult = 2 if r.cfg_scale != 1.0 else 1
    b, t, g = cfg.data.batch_size, r.grpo_sampling_steps, cfg.data.num_generations
    prompts = len({i // g for i in range(b)})  # distinct prompts among data-parallel rank 0's b samples
    sigmas = sigma_schedule(t, r.flow_shift)
    var = step_variance(r.sde_type, sigmas[:-1], sigmas[1:], r.eta, sigma_max=sigmas[1], sage_clamp=r.sage_sigma_clamp)
    position_kl = k_cfg.kl_weight > 0 and kl_term_weights(k_cfg)[0] > 0
    upr, accum = o.updates_per_rollout, o.gradient_accumulation_steps
    updates, refreshed_at, accum_rounds, synced = 0, 0, 0, True
    out = []
    for _ in range(steps):
        lo, hi = window_bounds(t, r.sde_window_start, r.sde_window_size, r.sde_window_stride, r.sde_window_every,
                               updates)
        k = num_train_timesteps(int(stochastic_steps(var[lo:hi]).numel()), o.timestep_fraction)
        prefix = lo if r.shared_prefix else 0  # ODE steps run once per prompt
        run = hi + tail_steps(hi, t, r.ode_steps)  # steps a sample takes: the tail in --ode_steps
        pairs_per_update = b // upr * k
        if accum_rounds == 0 and k_cfg.use_moving_KL and updates - refreshed_at >= k_cfg.update_ref_model_step:
            refreshed_at, synced = updates, True
        anchor = 0
        for _u in range(upr):  # the anchor's means are needed once the policy has moved away from it
            if position_kl and not synced:
                anchor += pairs_per_update * cfg_mult
            if upr > 1:
                updates, synced = updates + 1, False
        if upr == 1:
            accum_rounds += 1
            if accum_rounds == accum:
                updates, synced, accum_rounds = updates + 1, False, 0
        out.append({"rollout": ((run - prefix) * b + prefix * prompts) * cfg_mult, "anchor": anchor,
                    "update": b * k * cfg_mult, "vae_samples": b, "reward_calls": 1, "synced_at_start": anchor == 0})
    return out


def forwards_per_sample_step(cfg, steps: int) -> float:
    """Mean per-sample transformer forwards per step over `steps` steps (rollout + anchor + update)."""
    work = minimum_forwards(cfg, steps)
    return sum(w["rollout"] + w["anchor"] + w["update"] for w in work) / (steps * cfg.data.batch_size)


def step_flops(cfg, steps: int, *, latent: tuple[int, int, int] = (21, 22, 39), text_tokens: int = 256) -> dict:
    """Mean model FLOPs per step of a configuration over `steps` steps, by phase, for one data-parallel rank's
    samples (sage_grpo.flops: the real transformer's shape, forward + backward for trained pairs, no recomputation):
    {"rollout", "anchor", "update", "step"}. latent: [F, H, W] of the video (81x352x624 by default); text_tokens:
    the valid encoder tokens of each sample (256, the planner's assumption). The forwards are `minimum_forwards`'s,
    which the step benchmark checks against the loop's counted forwards."""
    from sage_grpo.flops import TransformerShape, transformer_flops

    shape = TransformerShape()
    n_video = shape.video_tokens(*latent)
    m = cfg.model
    train = ("lora" if m.use_lora else "full")
    r = m.lora_r if m.use_lora else 0
    fwd = transformer_flops(n_video, [text_tokens], shape, lora_r=r).model  # one sample's forward
    trained = transformer_flops(n_video, [text_tokens], shape, train=train, lora_r=r).model  # forward + backward
    frozen = transformer_flops(n_video, [text_tokens], shape).model  # the anchor: the base, adapters off
    work = minimum_forwards(cfg, steps)
    out = {"rollout": sum(w["rollout"] for w in work) * fwd / steps,
           "anchor": sum(w["anchor"] for w in work) * frozen / steps,
           "update": sum(w["update"] for w in work) * trained / steps}
    out["step"] = out["rollout"] + out["anchor"] + out["update"]
    return out


def real_size_flop_ratios(defaults, steps: int = 100) -> dict[str, float]:
    """Each recipe's model FLOPs per step over the paper's at the real size, from `defaults` (sage_grpo.config.Config()
    for what RECIPE_FLOP_RATIOS holds: the authors' T 20, 2 videos a rank, CFG) with the recipe's keys set."""
    import copy

    def flops(name: str) -> float:
        cfg = copy.deepcopy(defaults)
        for key, value in recipe_settings(name, cfg.rollout.grpo_sampling_steps).items():
            setattr(cfg.rollout if hasattr(cfg.rollout, key) else cfg.optim, key, value)
        return step_flops(cfg, steps)["step"]

    paper = flops("paper")
    return {name: flops(name) / paper for name in RECIPES}
