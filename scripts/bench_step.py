#!/usr/bin/env python
"""Benchmark K GRPO steps of post_train.py: work counted against its minimum, overhead ratio, phases, memory.

The real loop runs: `post_train.setup` builds the components and the train state and `post_train.train` takes K
steps; nothing is copied. The benchmark only instruments from outside: forward hooks on the transformer (and the
anchor copy), the text encoders and a wrapper on `vae.decode` and on the reward; `train`'s phase hook tags each
forward with its phase; the loop's own `perf/*` metrics come through a logger.

Reported per configuration (JSON: $OUT/bench_step.json when OUT is set, else outputs/bench/bench_step.json):
  counts     per step and phase, transformer work in per-sample forwards (a call on a batch of b counts b; with
             CFG predict_velocity runs one call on 2b), next to the minimum of the configuration:
               rollout  T x B x (2 with CFG)
               update   trained pairs B x k x (2 with CFG), k = int(T' x timestep_fraction) over the T' noisy steps
               anchor   the same as update, 0 while the anchor equals the policy (initial model / right after a
                        refresh, no optimizer update since) or without a position KL term
             VAE decode B samples and one reward call per step; the text encoder once per distinct prompt per run.
  overhead   step wall time / time inside transformer forward + backward, VAE decode and reward calls (same clock,
             same run; steps after the first); the remainder per phase says where the rest goes.
  phases     seconds per phase (the loop's perf/* numbers), peak RSS, peak allocated GPU memory per phase on CUDA;
             the transformer's model FLOPs per phase (sage_grpo.flops), TFLOP/s and MFU against --peak_tflops.
  pipeline   our rollout phase vs diffusers' HunyuanVideo15Pipeline (same T, CFG, prompts, batch; latents out).

    python scripts/bench_step.py                              # tiny + small on CPU, K = 4
    python scripts/bench_step.py --presets small --steps 5
    python scripts/bench_step.py --device cuda --presets tiny,small,real --real_width --real_blocks 2

`real` (needs --real_width): a real-width HunyuanVideo-1.5 transformer (diffusers' default config: 16 x 128 heads,
mlp 4, 2 refiner layers) with --real_blocks double-stream blocks, the real VAE config and the real text lengths
(1000 MLLM + 256 ByT5 + 729 image slots), random weights, tiny text encoders, bf16 autocast over fp32 master
weights with gradient checkpointing, at the real rollout size 81 x 352 x 624 (21 x 22 x 39 = 18,018 video tokens).
Transformer timings synchronise CUDA at hook boundaries, so on a GPU they are exact but the step is slightly
serialised.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sage_grpo.recipes import RECIPES, minimum_forwards, recipe_flags  # noqa: E402

# Video sizes per preset (overrides of configs/tiny_cpu.yaml). Tiny VAE: 4x spatial, 4x temporal, patch 1.
PRESETS = {
    "tiny": [],  # 9 x 32 x 32 -> 3 x 8 x 8 = 192 video tokens
    "small": ["--sample_n_frames", "13", "--height", "64", "--width", "64"],  # 4 x 16 x 16 = 1,024 video tokens
    "real": ["--sample_n_frames", "81", "--height", "352", "--width", "624", "--dtype", "bf16",
             "--master_weight_type", "fp32", "--enable_gradient_checkpointing", "True"],  # 21 x 22 x 39 = 18,018
}
PHASES = ("rollout", "anchor", "update")  # the phases that run transformer forwards
TRAIN_PHASES = ("refresh", "rollout", "reward", "plan", "anchor", "update", "optimizer")  # post_train.PhaseClock


def load_post_train():
    """post_train.py as a module (the same object the tests use when already imported)."""
    if "post_train" in sys.modules:
        return sys.modules["post_train"]
    spec = importlib.util.spec_from_file_location("post_train", ROOT / "post_train.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["post_train"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------------------ meter


class Meter:
    """Counts and times what the loop does, tagged by phase. `phase` is set by the phase wrappers."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = torch.device(device).type == "cuda"
        self.phase = "setup"
        self.reset()
        self.run_counts: dict = defaultdict(int)  # whole-run counters (text encoder)
        self._fwd_start: dict = {}
        self._bwd_start = None

    def reset(self) -> None:
        self.fwd = defaultdict(int)  # phase -> per-sample transformer forwards
        self.calls = defaultdict(int)  # phase -> transformer calls
        self.t = defaultdict(float)  # (phase, kind) -> seconds inside; kind in fwd, bwd, vae, reward, optimizer
        self.n = defaultdict(int)  # vae_samples, reward_calls, reward_videos, refreshes
        self.peak_gpu = defaultdict(float)  # phase -> peak allocated GiB

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()

    # transformer ------------------------------------------------------------------------------------------
    def attach_transformer(self, module) -> None:
        module.register_forward_pre_hook(self._pre, with_kwargs=True)
        module.register_forward_hook(self._post)

    def _pre(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        b = int(x.shape[0])
        self.fwd[self.phase] += b
        self.calls[self.phase] += 1
        self._fwd_start[id(module)] = self.now()

    def _post(self, module, args, output):
        self.t[(self.phase, "fwd")] += self.now() - self._fwd_start.pop(id(module))
        out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
        if self.torch.is_grad_enabled() and getattr(out, "requires_grad", False):
            out.register_hook(self._bwd_enter)

    def _bwd_enter(self, grad):
        """The backward reached the transformer's output: from here to the end of backward() is its backward."""
        self._bwd_start = self.now()

    @contextlib.contextmanager
    def backward_clock(self):
        autograd = self.torch.autograd
        original = autograd.backward

        def timed(*a, **k):
            out = original(*a, **k)
            if self._bwd_start is not None:
                self.t[(self.phase, "bwd")] += self.now() - self._bwd_start
                self._bwd_start = None
            return out

        autograd.backward = timed
        try:
            yield
        finally:
            autograd.backward = original

    # other models ------------------------------------------------------------------------------------------
    def attach_text_encoder(self, module, name: str) -> None:
        def pre(mod, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.run_counts[f"{name}_samples"] += int(ids.shape[0]) if ids is not None else 1
            self.run_counts[f"{name}_calls"] += 1

        module.register_forward_pre_hook(pre, with_kwargs=True)

    def wrap_vae_decode(self, vae) -> None:
        original = vae.decode

        def decode(z, *a, **k):
            t0 = self.now()
            out = original(z, *a, **k)
            self.t[(self.phase, "vae")] += self.now() - t0
            self.n["vae_samples"] += int(z.shape[0])
            return out

        vae.decode = decode

    def wrap_reward(self, reward):
        meter = self

        class Timed:
            def __call__(self, videos, prompts):
                t0 = meter.now()
                out = reward(videos, prompts)
                meter.t[(meter.phase, "reward")] += meter.now() - t0
                meter.n["reward_calls"] += 1
                meter.n["reward_videos"] += int(videos.shape[0])
                return out

            def __getattr__(self, name):
                return getattr(reward, name)

        return Timed()

    @contextlib.contextmanager
    def in_phase(self, name: str):
        previous, self.phase = self.phase, name
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            if self.cuda:
                self.peak_gpu[name] = max(self.peak_gpu[name], self.torch.cuda.max_memory_allocated() / 2**30)
            self.phase = previous

    def snapshot(self) -> dict:
        inside = {k: sum(v for (ph, kind), v in self.t.items() if kind == k) for k in ("fwd", "bwd", "vae", "reward")}
        return {"forwards": dict(self.fwd), "calls": dict(self.calls), "n": dict(self.n),
                "seconds_inside": {f"{ph}/{kind}": v for (ph, kind), v in self.t.items()}, "inside_total": inside,
                "peak_gpu_gib": dict(self.peak_gpu)}


def instrument_run(c, meter: Meter):
    """Hooks on the components: transformer, anchor (copy or adapter swap), VAE decode, reward -> the components
    with the timed reward."""
    meter.attach_transformer(c.transformer)
    anchor = c.anchor
    if anchor.model is not None:
        meter.attach_transformer(anchor.model)
    active, refresh = anchor.active, anchor.refresh

    @contextlib.contextmanager
    def anchor_active():
        with meter.in_phase("anchor"), active() as model:
            yield model

    def anchor_refresh():
        t0 = meter.now()
        refresh()
        meter.t[(meter.phase, "anchor_refresh")] += meter.now() - t0
        meter.n["refreshes"] += 1

    anchor.active, anchor.refresh = anchor_active, anchor_refresh
    meter.wrap_vae_decode(c.pipe.vae)
    return replace(c, reward=meter.wrap_reward(c.reward))


@contextlib.contextmanager
def hooked_pipeline_loader(meter: Meter):
    """setup() imports read_text_encoders from sage_grpo.models.loading at call time (its prompt cache loads the
    encoders with it when a prompt is not cached): hook the encoders it returns, so every encode is counted."""
    from sage_grpo.models import loading

    original = loading.read_text_encoders

    def load(*a, **k):
        encoders = original(*a, **k)
        for name, module in zip(("text_encoder", "text_encoder_2"), encoders):
            meter.attach_text_encoder(module, name)
        return encoders

    loading.read_text_encoders = load
    try:
        yield
    finally:
        loading.read_text_encoders = original


class CaptureLogger:
    """train's logger: receives the loop's metrics once per step (log_interval 1); closes the step's counters."""

    def __init__(self, meter: Meter):
        self.meter = meter
        self.steps: list[dict] = []
        self.last = None

    def log(self, step: int, metrics: dict) -> None:
        now = self.meter.now()
        self.steps.append({"step": step, "metrics": dict(metrics), "iteration_s": now - self.last,
                           **self.meter.snapshot()})
        self.meter.reset()
        self.last = self.meter.now()

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------------ minimum


# ------------------------------------------------------------------------------------------------------ runs


def write_real_width_checkpoint(out: Path, blocks: int) -> Path:
    """A real-width HunyuanVideo-1.5 with `blocks` double-stream blocks (diffusers' default transformer config,
    t2v), the real VAE config and text lengths, tiny random text encoders; the transformer's text input widths
    follow the tiny encoders (one input projection each: negligible next to the blocks)."""
    import json

    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel

    from sage_grpo.models.tiny import (
        TEXT_LENGTHS_FILE,
        TINY_BYT5_DIM,
        TINY_IMAGE_DIM,
        TINY_TEXT_DIM,
        TextLengths,
        build_tiny_components,
        default_system_message,
        tiny_crop_start,
    )

    comps = build_tiny_components(0)
    comps.pop("text_lengths")
    comps["transformer"] = HunyuanVideo15Transformer3DModel(
        num_layers=blocks, task_type="t2v", text_embed_dim=TINY_TEXT_DIM, text_embed_2_dim=TINY_BYT5_DIM,
        image_embed_dim=TINY_IMAGE_DIM).eval()
    comps["vae"] = AutoencoderKLHunyuanVideo15().eval()
    out.mkdir(parents=True, exist_ok=True)
    HunyuanVideo15Pipeline(**comps).save_pretrained(out, safe_serialization=True)
    start = tiny_crop_start(comps["tokenizer"], default_system_message())
    lengths = TextLengths(prompt_template_encode_start_idx=start)
    (out / TEXT_LENGTHS_FILE).write_text(json.dumps(lengths.to_dict(), indent=1) + "\n")
    return out


def config_argv(preset: str, model_path: Path, out_dir: Path, steps: int, extra: list[str]) -> list[str]:
    return ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model_path", str(model_path),
            "--pretrained_model_root", str(model_path.parent), "--output_dir", str(out_dir),
            "--train_video_csv", str(ROOT / "configs/tiny_prompts.txt"), *PRESETS[preset],
            "--max_steps", str(steps), "--save_interval", "0", "--validation_interval", "0", "--log_interval", "1",
            "--report_to", "none", *extra]


def video_tokens(c) -> int:
    cfg_t = c.transformer.config
    _, f, h, w = c.shape
    return (f // cfg_t.patch_size_t) * (h // cfg_t.patch_size) * (w // cfg_t.patch_size)


def measure(argv: list[str], steps: int, *, pipeline_repeats: int = 0, quiet: bool = True) -> dict:
    """Build the components of `argv` (post_train's own setup), train `steps` steps instrumented -> report dict."""
    from sage_grpo.config import load_config
    from sage_grpo.parallel.dist import destroy, init_distributed

    pt = load_post_train()
    cfg = load_config(argv, prog="bench_step.py")
    pt.preflight(cfg, 1)
    info = init_distributed(cfg.parallel.sp_size, cfg.parallel.dp_replicate)
    meter = Meter(info.device)
    try:
        t_setup = time.perf_counter()
        with hooked_pipeline_loader(meter):
            c, state = pt.setup(cfg, info, None)
        t_setup = time.perf_counter() - t_setup
        c = instrument_run(c, meter)
        logger = CaptureLogger(meter)
        with meter.backward_clock(), _quiet(quiet):
            meter.reset()
            logger.last = meter.now()
            t0 = time.perf_counter()
            # train's final checkpoint is no part of a step: the benchmark writes none
            pt.train(c, state, logger, hook=meter.in_phase, final_save=False)
            train_s = time.perf_counter() - t0
        pipeline = compare_pipeline(pt, c, state, meter, pipeline_repeats) if pipeline_repeats else None
    finally:
        destroy()
    return summarise(cfg, c, meter, logger.steps, train_s, t_setup, pipeline)


@contextlib.contextmanager
def _quiet(quiet: bool):
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def compare_pipeline(pt, c, state, meter: Meter, repeats: int) -> dict:
    """Our rollout phase vs diffusers' HunyuanVideo15Pipeline on the same prompts, T, CFG scale and batch
    (cached text embeddings given to both, latents out, no decode). Alternated, medians over `repeats`."""
    import torch

    cfg = c.cfg
    r = cfg.rollout
    pipe = c.pipe
    b = cfg.data.batch_size
    texts = [c.prompts[i % len(c.prompts)].prompt for i in range(b)]
    cond = c.cache.get(texts)
    uncond = c.cache.get([r.neg_prompt] * b)
    guider = getattr(pipe, "guider", None)
    if guider is not None:
        guider.guidance_scale = r.cfg_scale
        if hasattr(guider, "_enabled"):
            guider._enabled = r.cfg_scale != 1.0
    num_frames = r.sample_n_frames

    def ours():
        with meter.in_phase("ours"):
            pt.rollout_phase(c, state)

    def theirs():
        with meter.in_phase("diffusers"), torch.no_grad():
            pipe(prompt_embeds=cond.prompt_embeds, prompt_embeds_mask=cond.prompt_mask,
                 prompt_embeds_2=cond.byt5_embeds, prompt_embeds_mask_2=cond.byt5_mask,
                 negative_prompt_embeds=uncond.prompt_embeds, negative_prompt_embeds_mask=uncond.prompt_mask,
                 negative_prompt_embeds_2=uncond.byt5_embeds, negative_prompt_embeds_mask_2=uncond.byt5_mask,
                 height=r.height, width=r.width, num_frames=num_frames, num_inference_steps=r.grpo_sampling_steps,
                 generator=torch.Generator(device=c.info.device).manual_seed(0), output_type="latent")

    c.transformer.eval()
    times = {"ours": [], "diffusers": []}
    fwd = {"ours": [], "diffusers": []}
    counts = {}
    with _quiet(True):
        ours(), theirs()  # warm-up
        for _ in range(repeats):
            for name, fn in (("ours", ours), ("diffusers", theirs)):
                meter.reset()
                t0 = meter.now()
                fn()
                times[name].append(meter.now() - t0)
                fwd[name].append(meter.t[(name, "fwd")])
                counts[name] = {"forwards": meter.fwd[name], "calls": meter.calls[name]}
    meter.reset()
    med = {k: statistics.median(v) for k, v in times.items()}
    med_fwd = {k: statistics.median(v) for k, v in fwd.items()}
    return {"seconds_median": med, "transformer_forward_seconds_median": med_fwd, "counts": counts,
            "repeats": repeats, "ratio_ours_over_diffusers": med["ours"] / med["diffusers"],
            "layout": {"ours": "chunks of mini_batch_size_per_update samples, cond+uncond in one call of 2x",
                       "diffusers": "all samples per call, cond and uncond in separate calls"}}


def _median(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else math.nan


def summarise(cfg, c, meter: Meter, steps: list[dict], train_s: float, setup_s: float, pipeline) -> dict:
    import torch

    from sage_grpo.kl import kl_variant

    mins = minimum_forwards(cfg, len(steps))
    per_step = []
    for rec, mn in zip(steps, mins):
        f = rec["forwards"]
        counted = {"rollout": f.get("rollout", 0), "anchor": f.get("anchor", 0), "update": f.get("update", 0),
                   "vae_samples": rec["n"].get("vae_samples", 0), "reward_calls": rec["n"].get("reward_calls", 0)}
        other = {k: v for k, v in f.items() if k not in PHASES}
        m = rec["metrics"]
        inside = rec["inside_total"]
        inside_s = sum(inside.values())
        sec = rec["seconds_inside"]
        phase_s = {k: m.get(f"perf/{k}_s", 0.0) for k in TRAIN_PHASES}
        remainder = {
            "rollout": phase_s["rollout"] - sec.get("rollout/fwd", 0.0),
            "anchor_refresh": phase_s["refresh"],
            "reward": phase_s["reward"] - sec.get("reward/vae", 0.0) - sec.get("reward/reward", 0.0),
            "anchor+plan": phase_s["plan"] + phase_s["anchor"] - sec.get("anchor/fwd", 0.0),
            "update_optimizer_step": phase_s["optimizer"],
            "update_other": phase_s["update"] - sec.get("update/fwd", 0.0) - sec.get("update/bwd", 0.0),
        }
        # anchor forwards in training_phase mode run inside backward_phase under the "anchor" tag
        in_update = cfg.kl.kl_compute_mode == "training_phase"
        if in_update:
            remainder["update_other"] -= sec.get("anchor/fwd", 0.0)
            remainder["anchor+plan"] += sec.get("anchor/fwd", 0.0)
        phase_forwards = {"rollout": counted["rollout"], "anchor": 0 if in_update else counted["anchor"],
                          "update": counted["update"] + (counted["anchor"] if in_update else 0)}
        per_step.append({
            "step": rec["step"], "counts": counted, "phase_forwards": phase_forwards,  # per tag; inside each phase
            "minimum": {k: mn[k] for k in counted}, "other_forwards": other,
            "at_minimum": all(counted[k] == mn[k] for k in counted) and not other,
            "anchor_synced": m.get("kl/anchor_synced"), "updates_after": m.get("train/updates"),
            "step_s": m.get("perf/step_s"), "iteration_s": rec["iteration_s"], "phase_s": phase_s,
            "inside_s": inside, "inside_total_s": inside_s,
            "overhead_ratio": m.get("perf/step_s") / inside_s if inside_s else math.nan,
            "overhead_ratio_transformer_only": m.get("perf/step_s") / (inside["fwd"] + inside["bwd"])
            if inside["fwd"] + inside["bwd"] else math.nan,
            "remainder_s": remainder, "peak_gpu_gib": rec["peak_gpu_gib"], "mem_peak_gib": m.get("mem/peak_gib"),
            "ratio_min": m.get("train/ratio_min"), "ratio_max": m.get("train/ratio_max"),
            "approx_kl": m.get("train/approx_kl"),
            # the loop's transformer model FLOPs per phase (sage_grpo.flops), their rate and MFU (with a peak)
            "tflop": {k: m.get(f"perf/{k}_tflop", 0.0) for k in (*PHASES, "step")},
            "tflops": {k: m.get(f"perf/{k}_tflops") for k in (*PHASES, "step")},
            "mfu": {k: m.get(f"perf/{k}_mfu") for k in (*PHASES, "step")},
        })
    timed = per_step[1:] if len(per_step) > 1 else per_step  # the first step pays one-time costs
    needed = text_prompts_needed(cfg, c)
    distinct = needed | {rec.prompt for rec in c.val_records} | {cfg.rollout.neg_prompt}
    rc = dict(meter.run_counts)
    text = {"text_encoder_samples": rc.get("text_encoder_samples", 0),
            "text_encoder_calls": rc.get("text_encoder_calls", 0),
            "text_encoder_2_samples": rc.get("text_encoder_2_samples", 0),
            "minimum": len(needed), "distinct_prompts": len(distinct),
            "at_minimum": rc.get("text_encoder_samples", 0) == len(needed)}  # prompts a run never uses are not encoded
    med = lambda key: _median([s[key] for s in timed])  # noqa: E731
    summary = {
        "video_tokens": video_tokens(c), "latent_shape": list(c.shape),
        "batch_size": cfg.data.batch_size, "sampling_steps": cfg.rollout.grpo_sampling_steps,
        "cfg_scale": cfg.rollout.cfg_scale, "trained_steps_per_sample": minimum_trained_k(cfg),
        "kl_variant": kl_variant(cfg.kl), "kl_compute_mode": cfg.kl.kl_compute_mode,
        "steps": len(per_step), "steps_timed": [s["step"] for s in timed],
        "at_minimum": all(s["at_minimum"] for s in per_step) and text["at_minimum"],
        "text_encoder": text,
        "median": {
            "step_s": med("step_s"), "iteration_s": med("iteration_s"),
            "inside_total_s": med("inside_total_s"), "overhead_ratio": med("overhead_ratio"),
            "overhead_ratio_transformer_only": med("overhead_ratio_transformer_only"),
            "phase_s": {k: _median([s["phase_s"][k] for s in timed]) for k in timed[0]["phase_s"]},
            "inside_s": {k: _median([s["inside_s"][k] for s in timed]) for k in timed[0]["inside_s"]},
            "remainder_s": {k: _median([s["remainder_s"][k] for s in timed]) for k in timed[0]["remainder_s"]},
            "tflops": {k: _median([s["tflops"][k] for s in timed]) for k in (*PHASES, "step")},
            "mfu": {k: _median([s["mfu"][k] for s in timed]) for k in (*PHASES, "step")},
        },
        "aggregate_overhead_ratio": (sum(s["step_s"] for s in timed)
                                     / max(sum(s["inside_total_s"] for s in timed), 1e-12)),
        "train_wall_s": train_s, "setup_s": setup_s, "torch_threads": torch.get_num_threads(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_gpu_gib_by_phase": {k: max(s["peak_gpu_gib"].get(k, 0.0) for s in per_step)
                                  for k in {k for s in per_step for k in s["peak_gpu_gib"]}},
        "per_step": per_step,
        "pipeline_comparison": pipeline,
    }
    return summary


def text_prompts_needed(cfg, c) -> set:
    """The distinct prompts the run can use: the training prompts, the validation prompts when validation runs,
    the negative prompt when a CFG sampler (rollout, or validation with guidance) runs."""
    v = cfg.validation
    validates = bool(v.validation_interval) or v.validate_at_step0
    needed = {p.prompt for p in c.prompts}
    if validates:
        needed |= {rec.prompt for rec in c.val_records}
    if cfg.rollout.cfg_scale != 1.0 or (validates and v.validation_guidance_scale != 1.0):
        needed.add(cfg.rollout.neg_prompt)
    return needed


def minimum_trained_k(cfg) -> int:
    m = minimum_forwards(cfg, 1)[0]
    return m["update"] // (cfg.data.batch_size * (2 if cfg.rollout.cfg_scale != 1.0 else 1))


# ------------------------------------------------------------------------------------------------------ main


def parse(argv=None):
    from sage_grpo.cli import CLIParser

    ap = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,small", help="comma list of: " + ", ".join(PRESETS))
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps K per preset (the first is not timed)")
    ap.add_argument("--pipeline_repeats", type=int, default=3, help="repeats of the diffusers comparison (0 = skip)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--real_width", action="store_true", help="the `real` preset: real-width transformer")
    ap.add_argument("--real_blocks", type=int, default=2, help="double-stream blocks of the real-width transformer")
    ap.add_argument("--real_sampling_steps", type=int, default=8, help="T of the real preset")
    ap.add_argument("--model_path", default="", help="tiny checkpoint to use (default: build one in a temp dir)")
    ap.add_argument("--json", default="", help="output JSON (default $OUT/bench_step.json or outputs/bench/)")
    ap.add_argument("--extra", default="", help="more post_train overrides for every preset, e.g. '--kl_weight 0'")
    ap.add_argument("--peak_tflops", type=float, default=0.0, help="peak TFLOP/s of the device for MFU (post_train's "
                    "--peak_tflops; 0 = the device's dense bf16 peak from sage_grpo/flops.py, none on the CPU)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default); 1 on a "
                    "shared CPU avoids oversubscription")
    ap.add_argument("--recipes", default="", help="comma list of cheaper-steps recipes to run on every preset (their "
                    "flags after --extra; all = every one): " + ", ".join(RECIPES) + "; the report adds a table of "
                    "per-sample forwards per step against the paper's recipe")
    ap.add_argument("--keep_tmp", action="store_true", help="keep the temp dir (checkpoints built, run outputs)")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    a.presets = [p.strip() for p in a.presets.split(",") if p.strip()]
    for p in a.presets:
        if p not in PRESETS:
            ap.error(f"unknown preset {p!r}; choose from {', '.join(PRESETS)}")
    if "real" in a.presets and not a.real_width:
        ap.error("the `real` preset needs --real_width")
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    a.recipes = list(RECIPES) if a.recipes.strip() == "all" else [r.strip() for r in a.recipes.split(",") if r.strip()]
    for r in a.recipes:
        if r not in RECIPES:
            ap.error(f"unknown recipe {r!r}; choose from {', '.join(RECIPES)} or all")
    return a


def main(argv=None) -> int:
    import shlex

    a = parse(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # init_distributed picks CUDA whenever it is there
    import torch

    from sage_grpo.benchjson import default_json_path, write_report
    from sage_grpo.cli import quiet_libraries
    from sage_grpo.errors import SageGRPOError
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SageGRPOError("--device cuda: no CUDA device here")
    quiet_libraries()
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_step_"))
    tiny = Path(a.model_path) if a.model_path else write_tiny_checkpoint(tmp / "tiny" / "hv")
    results, ratios, notes = {}, {}, []
    from sage_grpo.config import load_config

    for preset in a.presets:
        for recipe in a.recipes or [None]:
            extra = ["--peak_tflops", str(a.peak_tflops), *shlex.split(a.extra)]
            if preset == "real":
                model = write_real_width_checkpoint(tmp / "real" / "hv", a.real_blocks)
                extra = ["--grpo_sampling_steps", str(a.real_sampling_steps), *extra]
            else:
                model = tiny
            name = preset if recipe is None else f"{preset}/{recipe}"
            run_dir = tmp / f"run_{name.replace('/', '_')}"
            argv_p = config_argv(preset, model, run_dir, a.steps, extra)
            if recipe is not None:
                argv_p += recipe_flags(recipe, load_config(argv_p).rollout.grpo_sampling_steps)
            print(f"[bench_step] {name}: {a.steps} steps ...", flush=True)
            res = measure(argv_p, a.steps, pipeline_repeats=a.pipeline_repeats, quiet=not a.verbose)
            res["overrides"] = argv_p[argv_p.index(str(run_dir)) + 1:]
            results[name] = res
            md = res["median"]
            ratios[f"{name}/overhead"] = md["overhead_ratio"]
            ratios[f"{name}/overhead_transformer_only"] = md["overhead_ratio_transformer_only"]
            if res["pipeline_comparison"]:
                ratios[f"{name}/rollout_over_diffusers"] = res["pipeline_comparison"]["ratio_ours_over_diffusers"]
            report_preset(name, res)
        if a.recipes:
            ratios.update(report_recipes(preset, {r: results[f"{preset}/{r}"] for r in a.recipes}))
    if a.device == "cpu":
        notes.append("real-width figures: not yet measured on a GPU (run with --device cuda --presets "
                     "tiny,small,real --real_width)")
    notes.append("CPU timings on a shared machine are noisy: compare ratios within one run")
    path = write_report(a.json or default_json_path("bench_step"), "bench_step",
                        "cuda" if a.device == "cuda" else "cpu", ratios, results, notes)
    print(f"[bench_step] wrote {path}")
    if not a.keep_tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # the real-width checkpoint alone is ~6 GB
    ok = all(r["at_minimum"] for r in results.values())
    print(f"[bench_step] transformer / VAE / reward / text-encoder work at the minimum: {ok}")
    return 0


def report_recipes(preset: str, res: dict[str, dict]) -> dict[str, float]:
    """The recipes' table: per-sample transformer forwards per step by phase (the update's are also its backward
    passes), at the minimum or not, and the median step time, against the paper's recipe when it ran -> ratios."""
    for r in res.values():
        n = len(r["per_step"]) * r["batch_size"]
        per = {k: sum(s["counts"][k] for s in r["per_step"]) / n for k in PHASES}
        r["forwards_per_sample_step"] = {**per, "total": sum(per.values())}
    ref = res.get("paper")
    print(f"== {preset}: recipes, per-sample transformer forwards per step (mean over the steps)")
    print("   recipe            rollout  anchor  update(=backward)  total  vs paper  at minimum  step_s  vs paper")
    ratios = {}
    for name, r in res.items():
        per = r["forwards_per_sample_step"]
        fwd_ratio = per["total"] / ref["forwards_per_sample_step"]["total"] if ref else math.nan
        step_ratio = r["median"]["step_s"] / ref["median"]["step_s"] if ref else math.nan
        if ref:
            ratios[f"{preset}/{name}/forwards_over_paper"] = fwd_ratio
            ratios[f"{preset}/{name}/step_s_over_paper"] = step_ratio
        print(f"   {name:<16}  {per['rollout']:>7.2f}  {per['anchor']:>6.2f}  {per['update']:>17.2f}  "
              f"{per['total']:>5.2f}  {fwd_ratio:>8.3f}  {str(r['at_minimum']):>10}  {r['median']['step_s']:>6.3f}  "
              f"{step_ratio:>8.3f}")
    return ratios


def report_preset(preset: str, res: dict) -> None:
    md = res["median"]
    print(f"== {preset}: {res['video_tokens']} video tokens, B {res['batch_size']}, T {res['sampling_steps']}, "
          f"k {res['trained_steps_per_sample']}, cfg {res['cfg_scale']}, KL {res['kl_variant']}")
    print("   step  rollout(min)  anchor(min)  update(min)  vae  reward  step_s  overhead")
    for s in res["per_step"]:
        c, m = s["counts"], s["minimum"]
        print(f"   {s['step']:>4}  {c['rollout']:>5}({m['rollout']:>5})  {c['anchor']:>5}({m['anchor']:>5})  "
              f"{c['update']:>5}({m['update']:>5})  {c['vae_samples']:>3}  {c['reward_calls']:>6}  "
              f"{s['step_s']:>6.3f}  {s['overhead_ratio']:>8.3f}")
    te = res["text_encoder"]
    print(f"   text encoder: {te['text_encoder_samples']} prompts encoded, minimum {te['minimum']} (distinct prompts)")
    print(f"   median step {md['step_s']:.3f} s, inside {md['inside_total_s']:.3f} s -> overhead "
          f"{md['overhead_ratio']:.3f} "
          f"(transformer only {md['overhead_ratio_transformer_only']:.3f}); phases "
          + ", ".join(f"{k} {v:.3f}" for k, v in md["phase_s"].items()))
    print("   remainder: " + ", ".join(f"{k} {v:.4f}" for k, v in md["remainder_s"].items()))
    print("   transformer TFLOP/s (model FLOPs / phase seconds): "
          + ", ".join(f"{k} {v:.4g}" for k, v in md["tflops"].items() if math.isfinite(v))
          + ("; MFU " + ", ".join(f"{k} {v:.1%}" for k, v in md["mfu"].items() if math.isfinite(v))
             if math.isfinite(md["mfu"]["step"]) else "; MFU: no peak (the CPU or a device not in the table: "
             "--peak_tflops)"))
    print(f"   peak RSS {res['peak_rss_gib']:.2f} GiB" + (f", GPU peak by phase {res['peak_gpu_gib_by_phase']}"
                                                        if res["peak_gpu_gib_by_phase"] else ""))
    pc = res["pipeline_comparison"]
    if pc:
        print(f"   rollout vs diffusers pipeline: ours {pc['seconds_median']['ours']:.3f} s, diffusers "
              f"{pc['seconds_median']['diffusers']:.3f} s -> ratio {pc['ratio_ours_over_diffusers']:.3f} "
              f"(forwards {pc['counts']})")


if __name__ == "__main__":
    from sage_grpo.errors import run_cli

    sys.exit(run_cli(main))
