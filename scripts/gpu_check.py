#!/usr/bin/env python
"""The first command on a new GPU cluster: real-size HunyuanVideo-1.5 on one GPU, measured against the memory planner.

    python scripts/gpu_check.py                      # every stage, one after another (each ends within ~10 min)
    python scripts/gpu_check.py --stage lora         # one stage (e.g. one per GPU session)
    python scripts/gpu_check.py --update_readme      # also write a summary into README.md ("Measured on a GPU")
    python scripts/gpu_check.py --tiny               # the same stages with a tiny random model on the CPU (a test)
    python scripts/gpu_check.py --version 720p_i2v --stage lora --out outputs/gpu_check_720p_i2v   # another checkpoint
    python scripts/gpu_check.py --stage lora --fp8_base --memory_cap_gib 24 --out outputs/gpu_check_24gb  # a 24 GB card

Needs torch, diffusers, transformers, safetensors, peft, einops, imageio (pip install -e '.[lora]'); what is missing
is named before anything runs. Random weights unless --model_path names a diffusers-layout HunyuanVideo-1.5 (then its
weights and text encoders are used). Stages, each writing $OUT/gpu_check_<stage>.json (sage_grpo.benchjson's format;
outputs/gpu_check/ without $OUT) and rewriting gpu_check.md, the markdown tables of every stage present:

  build      the 480p_t2v transformer (54 blocks) built on the meta device and materialised on the GPU with random
             weights, the real VAE and the text path: resident GiB per part next to the planner's parameter bytes.
  attention  scripts/bench_attention.py: one real-width block, valid-token attention vs diffusers' processor (bf16
             outputs agree to bf16 rounding at the real size; fp32 outputs and gradients on the device).
  memory     scripts/measure_memory.py: per-block activations and VAE decode, measured beside the planner.
  lora       2 GRPO steps of post_train.py itself (post_train.setup + post_train.train through
             scripts/bench_step.py's instrumentation) at 81x352x624, LoRA on a bf16 frozen base, valid-token
             attention, gradient checkpointing, tiled decode: seconds per phase and per video, per-sample transformer
             forwards per phase, peak GiB per phase next to scripts/plan_memory.py's plan for the same flags
             (PASS within --tolerance, else FAIL; "not run" for a forward phase that did no forward), the
             transformer's TFLOP/s per phase with MFU against the card's dense bf16 peak (--peak_tflops, default
             the datasheet's, sage_grpo/flops.py) and against its own bf16 matmul rate (measured once, 8192^3), and
             the first update's ratio (1 to float32 rounding, and whether exactly: re-scoring reproduces the
             rollout's log-probs).
  full       the same for full fine-tuning (fp32 master weights, AdamW + Muon, anchor copy), at the depth the planner
             says fits this GPU.
  compile    the lora flags at --compile_blocks blocks, eager and --compile: seconds per phase of each.
  recipes    the lora flags at --compile_blocks blocks once per cheaper-steps recipe (sage_grpo.recipes: paper,
             cfg_free, window, sliding, sliding_shared, cfg_free_sliding): median step seconds, per-sample
             transformer forwards per step (at the minimum or not) and the first update's ratio, against paper.
  bench_step scripts/bench_step.py --real_width (a 2-block real-width model: overhead ratio, work at the minimum,
             our rollout vs diffusers' pipeline).

--version picks the checkpoint measured (default 480p_t2v; every name of sage_grpo.models.tiny.VARIANTS): its
transformer config (random weights, the same architecture), its flow shift and CFG scale, and its size. 480p_t2v
trains at the paper's 81x352x624; every other version at the bucket of a 16:9 image at its target size (the size
diffusers' pipelines give such an image: 720p 81x720x1280, about 76k video tokens; 480p I2V 81x480x848). An I2V
version adds the SigLIP image encoder (so400m, random; the checkpoint's with --model_path) and trains on a prompt
file of 16:9 reference images at that bucket, written beside the random checkpoints; the build, memory, lora, full
and compile stages use the version, attention and bench_step measure the 480p T2V block as before. Give each version
its own --out (the reports are named by stage).

The planner's comparison uses the memory the CUDA allocator reports (max_memory_allocated per phase), so the plan is
taken without its --overhead_gib (CUDA context, NCCL, fragmentation: not allocated tensors), and with the parts this
run really has: the text encoders and reward of the checkpoint (tiny text encoders with the real text lengths and the
demo brightness reward for random weights: no reward model). On the CPU (--tiny) there is no allocator to read:
every comparison says "not measured", and the run proves that the stages, the planner call and the report work.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

GIB = 2**30
STAGES = ("build", "attention", "memory", "lora", "full", "compile", "recipes", "bench_step")
NEEDED = ("torch", "diffusers", "transformers", "safetensors", "peft", "einops", "imageio", "yaml")
# PhaseClock's phase (post_train.train) -> the planner's phase (sage_grpo.memory.plan)
PHASE_MAP = {"rollout": "rollout", "reward": "decode+reward", "anchor": "anchor", "update": "update",
             "optimizer": "optimizer step"}
README_BEGIN, README_END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
NOT_MEASURED = "not yet measured on a GPU"
# the real rollout size and the tiny one (tiny VAE: 4x spatial, 4x temporal) of 480p_t2v; other versions train at
# the bucket of an image of this shape (`geometry`): 16:9, or square on the tiny model (its 16:9 buckets, in 4 px
# steps, are not the multiples of 16 that --height/--width must be)
GEOMETRY = {"real": (81, 352, 624), "tiny": (9, 32, 32)}
DEFAULT_VERSION, IMAGE_HW = "480p_t2v", {"real": (1080, 1920), "tiny": (1080, 1080)}


# ------------------------------------------------------------------------------------------------ comparison


def compare_phases(measured: dict, planned: dict, tolerance: float, forwards: dict | None = None) -> list[dict]:
    """Measured peak GiB per PhaseClock phase against the planner's phases (PHASE_MAP) -> one row per phase:
    verdict PASS when |planned - measured| <= tolerance x measured, FAIL otherwise, "not measured" when no peak was
    recorded (no CUDA allocator, or no such phase), "not run" when `forwards` (transformer forwards inside each
    phase, summed over the measured steps) says a forward phase did none: its peak is then only what stays resident
    (the anchor phase of a run's first step, whose anchor is the rollout's policy)."""
    rows = []
    for phase, plan_phase in PHASE_MAP.items():
        m, p = measured.get(phase), planned.get(plan_phase)
        row = {"phase": phase, "plan_phase": plan_phase, "measured_gib": m, "planned_gib": p}
        if m is None or p is None or m <= 0:
            row.update(error=None, verdict="not measured")
        elif forwards is not None and forwards.get(phase) == 0:
            row.update(error=None, verdict="not run")
        else:
            row["error"] = (p - m) / m
            row["verdict"] = "PASS" if abs(row["error"]) <= tolerance else "FAIL"
        rows.append(row)
    return rows


# a float32 log-prob averaged over a video's latent elements, recomputed with another batch composition or kernel,
# can land a few roundings away (measured on an H200: 1 - 1.2e-7 for full fine-tuning, exactly 1 for LoRA); a
# re-scoring that is really off (another sigma, noise level or dtype) misses by orders of magnitude more, and the
# default clip range is 1e-4
RATIO_TOLERANCE = 1e-6


def ratio_verdict(ratio_min: float, ratio_max: float) -> dict:
    """The first update's ratios (step 1 re-scores the rollout before any optimizer update) -> exact (every ratio
    exactly 1), deviation (max |ratio - 1|) and verdict: PASS within RATIO_TOLERANCE, FAIL otherwise."""
    if ratio_min is None or ratio_max is None or not (math.isfinite(ratio_min) and math.isfinite(ratio_max)):
        return {"exact": False, "deviation": math.nan, "verdict": "FAIL"}  # no ratio logged, or a NaN / inf one
    deviation = max(abs(ratio_min - 1.0), abs(ratio_max - 1.0))
    return {"exact": ratio_min == 1.0 == ratio_max, "deviation": deviation,
            "verdict": "PASS" if deviation <= RATIO_TOLERANCE else "FAIL"}


def part_verdict(planned_gib: float, measured_gib: float, tensors: int, tolerance: float) -> str:
    """A part's resident bytes against its parameter bytes: PASS within `tolerance` x measured, plus the CUDA
    caching allocator's rounding of each tensor up to 512 bytes and the part's buffers (which parameter bytes leave
    out), at most 512 bytes per tensor: a part of a few KB (the tiny text encoders) is all rounding."""
    slack = tolerance * max(measured_gib, 0.0) + 512 * tensors / GIB
    return "PASS" if abs(planned_gib - measured_gib) <= slack else "FAIL"


# ------------------------------------------------------------------------------------------------ models


def transformer_config(tiny: bool, blocks: int, version: str = DEFAULT_VERSION) -> dict:
    """`version`'s config (diffusers' converter) with `blocks` double-stream blocks, or its tiny config with `blocks`;
    the text input widths follow the tiny text encoders of the random checkpoints (one projection each: negligible),
    and so does the image input's of a T2V version (zeros); an I2V version keeps SigLIP's 1152."""
    from sage_grpo.memory import transformer_config as planned_config
    from sage_grpo.models.tiny import TINY_BYT5_DIM, TINY_IMAGE_DIM, TINY_TEXT_DIM, tiny_variant_config

    if tiny:
        return {**tiny_variant_config(version), "num_layers": blocks}
    cfg = planned_config(version)
    cfg.update(num_layers=blocks, text_embed_dim=TINY_TEXT_DIM, text_embed_2_dim=TINY_BYT5_DIM)
    if cfg["task_type"] != "i2v":
        cfg["image_embed_dim"] = TINY_IMAGE_DIM
    cfg["rope_axes_dim"] = tuple(cfg["rope_axes_dim"])
    return cfg


def geometry(tiny: bool, version: str) -> tuple[int, int, int]:
    """(frames, height, width) of the measured runs: GEOMETRY for 480p_t2v; for every other version the bucket of a
    16:9 image (square on the tiny model) at its target size, in its VAE's 16 px steps (the tiny VAE's 4), as
    diffusers' pipelines size such an image (an I2V video's size comes from its image)."""
    from sage_grpo.models.image_cond import bucket_size

    frames, height, width = GEOMETRY["tiny" if tiny else "real"]
    if version == DEFAULT_VERSION:
        return frames, height, width
    key = "tiny" if tiny else "real"
    return frames, *bucket_size(*IMAGE_HW[key], transformer_config(tiny, 1, version)["target_size"], 4 if tiny else 16)


def random_fill_(module, seed: int = 0) -> None:
    """Small random values in every parameter, on the parameter's device (no host copy of a large model)."""
    import torch

    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=g)


def random_components(tiny: bool, version: str = DEFAULT_VERSION) -> tuple[dict, object]:
    """The parts of a random checkpoint besides the transformer: tiny text encoders and tokenizers (the real text
    lengths unless tiny), the real VAE (the tiny one when tiny), an I2V version's SigLIP (so400m's vision tower and
    its 384 px processor; the tiny one when tiny), the version's scheduler shift and CFG scale -> (components, text
    lengths)."""
    from diffusers import AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

    from sage_grpo.models.tiny import (
        TextLengths,
        build_tiny_components,
        default_system_message,
        tiny_crop_start,
        variant_of,
    )

    v = variant_of(version)
    comps = build_tiny_components(0, task=v.task)
    lengths = comps.pop("text_lengths")
    comps.pop("transformer")
    comps["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=v.flow_shift)
    comps["guider"] = ClassifierFreeGuidance(guidance_scale=v.guidance_scale)
    if not tiny:
        comps["vae"] = AutoencoderKLHunyuanVideo15().eval()
        lengths = TextLengths(prompt_template_encode_start_idx=tiny_crop_start(comps["tokenizer"],
                                                                                default_system_message()))
        if v.task == "i2v":  # 729 tokens of width 1152, as the I2V checkpoints' SigLIP gives
            from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

            from sage_grpo.memory import SIGLIP_SO400M

            comps["image_encoder"] = SiglipVisionModel(SiglipVisionConfig(**SIGLIP_SO400M)).eval()
            comps["feature_extractor"] = SiglipImageProcessor(size={"height": 384, "width": 384})
    return comps, lengths


def parts_of(comps: dict) -> dict:
    """The planner's `frozen` counts of `comps`: no reward model (the demo brightness reward has no weights)."""
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {"vae": n(comps["vae"]), "vae_config": dict(comps["vae"].config), "text_encoder": n(comps["text_encoder"]),
            "byt5": n(comps["text_encoder_2"]), "reward": 0,
            **({"image_encoder": n(comps["image_encoder"])} if "image_encoder" in comps else {})}


def write_checkpoint(out: Path, tcfg: dict, tiny: bool, device, version: str = DEFAULT_VERSION) -> Path:
    """A diffusers-layout HunyuanVideo-1.5 with random weights: the transformer of `tcfg` (built on meta, materialised
    on `device`, saved in bf16) and random_components of `version` (an I2V one saved as
    HunyuanVideo15ImageToVideoPipeline, with its image encoder). Written once: a complete folder is reused."""
    import torch
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel

    from sage_grpo.models.tiny import TEXT_LENGTHS_FILE

    if (out / TEXT_LENGTHS_FILE).exists():  # written last
        return out
    comps, lengths = random_components(tiny, version)
    with torch.device("meta"):
        transformer = HunyuanVideo15Transformer3DModel(**tcfg).to(torch.bfloat16)
    transformer = transformer.to_empty(device=device)  # bf16 from the start: no fp32 copy of 8.3B parameters
    random_fill_(transformer)
    comps["transformer"] = transformer.eval()
    out.mkdir(parents=True, exist_ok=True)
    pipeline = HunyuanVideo15ImageToVideoPipeline if "image_encoder" in comps else HunyuanVideo15Pipeline
    pipeline(**comps).save_pretrained(out, safe_serialization=True)
    (out / TEXT_LENGTHS_FILE).write_text(json.dumps(lengths.to_dict(), indent=1) + "\n")
    del comps, transformer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def frozen_parts(ck, blocks: int) -> dict:
    """Parameter counts of the parts besides the transformer (the planner's `frozen`): random_components' for random
    weights; the public configs (sage_grpo.memory.count_frozen_parts) for real weights; no reward model (the demo
    reward)."""
    if not ck.real_weights(blocks):
        if ck.parts is None:
            ck.parts = parts_of(random_components(ck.tiny, ck.version)[0])
        return ck.parts
    from sage_grpo.memory import count_frozen_parts

    return {**count_frozen_parts(), "reward": 0}


def matmul_tflops(device: str, n: int = 8192, reps: int = 20) -> float | None:
    """The card's own dense bf16 matrix rate (TFLOP/s): [n, n] @ [n, n] in bf16, timed with CUDA events after a
    warm-up, 2 n^3 FLOPs each. None on the CPU (the --tiny check)."""
    if device != "cuda":
        return None
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.mm(a, b, out=out)
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def utilisation(tflops: dict, peak: float | None, matmul: float | None) -> dict:
    """Per phase: TFLOP/s, MFU against the datasheet peak and against the card's measured matmul rate (None where
    not measured)."""
    ok = lambda x: x is not None and math.isfinite(x)  # noqa: E731
    return {ph: {"tflops": v if ok(v) else None, "mfu": v / peak if ok(v) and peak else None,
                 "of_matmul": v / matmul if ok(v) and matmul else None} for ph, v in tflops.items()}


# ------------------------------------------------------------------------------------------------ context


class Check:
    """Arguments, device, output folder and the per-stage reports."""

    def __init__(self, a):
        import torch

        from sage_grpo.errors import SageGRPOError
        from sage_grpo.models.tiny import variant_of

        self.a = a
        self.tiny = a.tiny
        self.version, self.variant = a.version, variant_of(a.version)  # an unknown name: one line with the valid ones
        if a.model_path:
            from sage_grpo.models.loading import locate_model

            task = locate_model("", a.model_path, "").task
            if task != self.variant.task:
                raise SageGRPOError(f"--model_path {a.model_path} is a {task.upper()} checkpoint but --version "
                                    f"{a.version} is {self.variant.task.upper()}; pass its version")
        self.device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpts = Path(a.ckpt_dir)
        self.frames, self.height, self.width = geometry(a.tiny, a.version)
        self.parts = None  # frozen_parts, computed once
        self._matmul: list = []  # the card's measured bf16 matmul TFLOP/s, measured once
        self.gpu_gib = (a.gpu_memory_gib or (torch.cuda.get_device_properties(0).total_memory / GIB
                                             if self.device == "cuda" else 16.0))
        if a.memory_cap_gib:  # every plan is judged against the cap, and the allocator refuses more than it
            self.gpu_gib = a.memory_cap_gib
            cap_allocator(a.memory_cap_gib, self.device)
        self.lora_flags = [*LORA_FLAGS, *(["--fp8_base", "True"] if a.fp8_base else [])]

    def matmul_tflops(self) -> float | None:
        if not self._matmul:
            self._matmul.append(matmul_tflops(self.device))
        return self._matmul[0]

    def peak_tflops(self) -> float | None:
        """The dense bf16 peak MFU is computed against: --peak_tflops, else the datasheet table's for this card."""
        from sage_grpo.flops import device_peak_tflops

        return device_peak_tflops(self.a.peak_tflops, self.device, "bf16")

    def real_weights(self, blocks: int) -> bool:
        return bool(self.a.model_path) and blocks == self.tcfg_of_model_path()["num_layers"]

    def tcfg_of_model_path(self) -> dict:
        from sage_grpo.models.loading import locate_model, read_transformer_config

        return dict(read_transformer_config(locate_model("", self.a.model_path, "").root / "transformer"))

    def tcfg(self, blocks: int) -> dict:
        """The transformer config of the model measured at `blocks` blocks."""
        return (self.tcfg_of_model_path() if self.real_weights(blocks)
                else transformer_config(self.tiny, blocks, self.version))

    def model_dir(self, kind: str, blocks: int) -> Path:
        """--model_path when given and as deep (real weights), else a random checkpoint with `blocks` blocks."""
        if self.real_weights(blocks):
            return Path(self.a.model_path)
        name = f"{kind}_{blocks}" if self.version == DEFAULT_VERSION else f"{kind}_{self.version}_{blocks}"
        return write_checkpoint(self.ckpts / name, transformer_config(self.tiny, blocks, self.version), self.tiny,
                                self.device, self.version)

    def prompt_file(self) -> Path:
        """The training prompts: configs/tiny_prompts.txt, each with a 16:9 reference image at this check's size for
        an I2V version (written once beside the random checkpoints: smooth random pictures)."""
        if self.variant.task != "i2v":
            return ROOT / "configs/tiny_prompts.txt"
        import numpy as np
        import PIL.Image
        import torch

        folder = self.ckpts / f"prompts_{self.height}x{self.width}"
        csv = folder / "prompts.csv"
        if csv.exists():  # written last
            return csv
        folder.mkdir(parents=True, exist_ok=True)
        prompts = (ROOT / "configs/tiny_prompts.txt").read_text().split("\n")
        rows = ["prompt,ref_image_path"]
        for i, prompt in enumerate(x.strip() for x in prompts if x.strip()):
            coarse = torch.rand(1, 3, 6, 10, generator=torch.Generator().manual_seed(i))
            img = torch.nn.functional.interpolate(coarse, size=(self.height, self.width), mode="bilinear")[0]
            PIL.Image.fromarray((img.permute(1, 2, 0).numpy() * 255).astype(np.uint8)).save(folder / f"{i}.png")
            rows.append(f'"{prompt}",{i}.png')
        csv.write_text("\n".join(rows) + "\n")
        return csv

    def post_train_argv(self, model_dir: Path, run: str, flags: list[str]) -> list[str]:
        """post_train.py's flags for a measured run: configs/tiny_cpu.yaml's demo reward and prompts (with images for
        I2V), this check's geometry (the planner's --height/--width; an I2V run takes the same from its images), the
        version's flow shift and CFG scale, `flags` on top (see bench_step.config_argv)."""
        return ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model_path", str(model_dir),
                "--pretrained_model_root", str(model_dir.parent), "--output_dir", str(self.ckpts / "runs" / run),
                "--overwrite_output_dir", "True",
                "--train_video_csv", str(self.prompt_file()), "--pretrained_transformer_version", self.version,
                "--flow_shift", f"{self.variant.flow_shift:g}", "--cfg_scale", f"{self.variant.guidance_scale:g}",
                "--sample_n_frames", str(self.frames), "--height", str(self.height), "--width", str(self.width),
                "--batch_size", "2", "--num_generations", "2", "--grpo_sampling_steps", str(self.a.sampling_steps),
                "--enable_gradient_checkpointing", "True", "--vae_tiling", "True", "--offload_text_encoder", "True",
                "--max_steps", str(self.a.steps), "--save_interval", "0", "--validation_interval", "0",
                "--log_interval", "1", "--report_to", "none", "--peak_tflops", f"{self.a.peak_tflops:g}", *flags]

    def write(self, stage: str, ratios: dict, results: dict, notes: list[str]) -> Path:
        from sage_grpo.benchjson import write_report

        path = write_report(self.out / f"gpu_check_{stage}.json", f"gpu_check_{stage}", self.device, ratios,
                            {"tiny": self.tiny, **results}, notes)
        (self.out / "gpu_check.md").write_text(render_markdown(self.out) + "\n")
        return path


LORA_FLAGS = ["--use_lora", "True", "--dtype", "bf16", "--master_weight_type", "bf16"]


def cap_allocator(cap_gib: float, device: str) -> float | None:
    """Cap this process's CUDA allocator at `cap_gib` (torch.cuda.set_per_process_memory_fraction: an allocation past
    it raises out-of-memory, as on a card of that size; the CUDA context is not counted) -> the fraction set, or
    None on the CPU (no allocator to cap: a no-op)."""
    import torch

    from sage_grpo.errors import SageGRPOError

    if device != "cuda":
        print(f"[gpu_check] --memory_cap_gib {cap_gib:g}: no CUDA allocator on the CPU, nothing capped", flush=True)
        return None
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    if not 0 < cap_gib <= total:
        raise SageGRPOError(f"--memory_cap_gib must be in (0, {total:.1f}] (this GPU's memory), got {cap_gib:g}")
    torch.cuda.set_per_process_memory_fraction(cap_gib / total, 0)
    return cap_gib / total
FULL_FLAGS = ["--use_lora", "False", "--dtype", "bf16", "--master_weight_type", "fp32"]


# ------------------------------------------------------------------------------------------------ stages


def stage_build(ck: Check) -> dict:
    """Materialise the transformer from the meta device on the device, then the VAE and the text encoders; resident
    GiB of each next to its parameter bytes (the planner's weight terms)."""
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.attention import use_valid_token_attention

    blocks = 2 if ck.tiny else 54
    tcfg = transformer_config(ck.tiny, blocks, ck.version)
    cuda = ck.device == "cuda"
    allocated = (lambda: torch.cuda.memory_allocated() / GIB) if cuda else (lambda: math.nan)
    rows, t0 = [], time.perf_counter()
    base = allocated()
    with torch.device("meta"):
        transformer = HunyuanVideo15Transformer3DModel(**tcfg).to(torch.bfloat16)
    use_valid_token_attention(transformer)
    if ck.a.model_path:  # real weights: what load_pipeline reads (text encoders included)
        from sage_grpo.models.loading import load_pipeline

        pipe = load_pipeline(model_path=ck.a.model_path, dtype="bf16", device=ck.device)
        parts = {"transformer": pipe.transformer, "vae": pipe.vae, "text_encoder": pipe.text_encoder,
                 "text_encoder_2": pipe.text_encoder_2}
        if getattr(pipe, "image_encoder", None) is not None:
            parts["image_encoder"] = pipe.image_encoder
    else:
        transformer = transformer.to_empty(device=ck.device)
        random_fill_(transformer)
        comps = random_components(ck.tiny, ck.version)[0]  # the VAE of that size, an I2V version's SigLIP
        parts = {"transformer": transformer, "vae": comps["vae"], "text_encoder": comps["text_encoder"],
                 "text_encoder_2": comps["text_encoder_2"]}
        if "image_encoder" in comps:
            parts["image_encoder"] = comps["image_encoder"]
    build_s = time.perf_counter() - t0
    for name, mod in parts.items():
        before = allocated()
        mod = mod.to(ck.device, torch.bfloat16)
        parts[name] = mod
        params = sum(p.numel() for p in mod.parameters())
        tensors = len(list(mod.parameters())) + len(list(mod.buffers()))
        planned = params * 2 / GIB
        # the transformer is already resident when it was materialised there: its bytes are counted from the start
        measured = allocated() - (base if name == "transformer" else before)
        rows.append({"part": name, "params": params, "tensors": tensors, "planned_gib": planned,
                     "measured_gib": measured, "verdict": "not measured" if not cuda else
                     part_verdict(planned, measured, tensors, ck.a.tolerance)})
    from sage_grpo.memory import build_transformer, count_transformer

    counted = count_transformer(build_transformer(tcfg))
    exact = counted["total"] == rows[0]["params"]
    res = {"version": ck.version, "blocks": blocks, "build_s": build_s, "parts": rows,
           "planner_counts_transformer_exactly": exact, "config": tcfg}
    notes = [] if cuda else [f"resident memory: {NOT_MEASURED} (CPU)"]
    ck.write("build", {"transformer_params": rows[0]["params"]}, res, notes)
    return res


def stage_attention(ck: Check) -> dict:
    import bench_attention

    res = bench_attention.main(["--cpu"] if ck.tiny else ["--reps", "5"])
    ok = {}
    for b in (1, 2):
        diff, mean = res.get(f"b{b}_block_out_max_abs_diff"), res.get(f"b{b}_block_out_mean_abs")
        # to bf16 rounding: gpu_facts.md measured 0.0156 max abs on outputs of mean |x| 0.46 (a few bf16 ulps of the
        # largest outputs); on the CPU in fp32 the difference is ~1e-7
        ok[f"b{b}"] = "PASS" if diff is not None and diff <= 0.05 * mean else "FAIL"
    chk = res["check"]
    ok["fp32"] = "PASS" if chk["fp32_out_max_rel_diff"] < 1e-5 and chk["fp32_grad_max_rel_diff"] < 1e-4 else "FAIL"
    ck.write("attention", {f"{r['part']}/b{r['batch']}/{r['impl']}": r["fwdbwd_ratio"] for r in res["rows"]},
             {"bench_attention": res, "verdicts": ok}, [])
    return ok


def stage_memory(ck: Check) -> dict:
    import measure_memory

    argv = ["--device", ck.device, "--out", str(ck.out / "measure_memory.json")]
    if not ck.tiny:  # this version's size; I2V's 729 SigLIP tokens are valid encoder tokens like the prompt's
        argv += ["--frames", str(ck.frames), "--height", str(ck.height), "--width", str(ck.width),
                 "--valid_text", str(200 + (729 if ck.variant.task == "i2v" else 0))]
    # --tiny skips the VAE decode here: the lora and full stages decode through post_train's tiled path anyway
    res = measure_memory.main(argv + (["--small", "--skip_vae"] if ck.tiny else []))
    ck.write("memory", {}, {"measure_memory": res}, [])
    return res


def planned_phases(argv: list[str], tcfg: dict, parts: dict, gpu_gib: float, overhead_gib: float = 0.0,
                   counts: dict | None = None) -> dict:
    """The planner's plan (sage_grpo.memory, scripts/plan_memory.py) of the post_train run `argv` on one GPU, for the
    transformer `tcfg` (its parameter `counts` when already known) and the other parts' counts `parts`; overhead_gib
    0 leaves out what the allocator does not see (the CUDA context)."""
    from sage_grpo.config import load_config
    from sage_grpo.memory import PlanOptions, build_transformer, count_transformer, plan

    cfg = load_config(argv, prog="gpu_check.py")
    m = cfg.model
    if counts is None:
        counts = count_transformer(build_transformer(tcfg), use_lora=m.use_lora, lora_r=m.lora_r,
                                   lora_alpha=m.lora_alpha, lora_target_modules=m.lora_target_modules)
    return plan(cfg, PlanOptions(world_size=1, gpu_memory_gib=gpu_gib, overhead_gib=overhead_gib), counts, parts,
                tcfg=tcfg)


def measured_run(ck: Check, stage: str, kind: str, blocks: int, flags: list[str]) -> dict:
    """Train ck.a.steps steps of post_train.py instrumented (bench_step.measure) and compare with the plan."""
    import bench_step

    model_dir = ck.model_dir(kind, blocks)
    argv = ck.post_train_argv(model_dir, f"{stage}_{blocks}", flags)
    tcfg = ck.tcfg(blocks)
    pl = planned_phases(argv, tcfg, frozen_parts(ck, blocks), ck.gpu_gib)
    t0 = time.perf_counter()
    res = bench_step.measure(argv, ck.a.steps, pipeline_repeats=0, quiet=not ck.a.verbose)
    wall = time.perf_counter() - t0
    measured = res["peak_gpu_gib_by_phase"]
    forwards = {ph: sum(s["phase_forwards"][ph] for s in res["per_step"]) for ph in ("rollout", "anchor", "update")}
    rows = compare_phases(measured, pl["phases_gib"], ck.a.tolerance, forwards)
    first = res["per_step"][0]
    videos = res["batch_size"]
    phase_s = res["median"]["phase_s"]
    out = {
        "version": ck.version, "geometry": [ck.frames, ck.height, ck.width], "task": ck.variant.task,
        "blocks": blocks, "flags": flags, "argv": argv, "wall_s": wall, "videos_per_step": videos,
        "seconds_per_phase": phase_s, "seconds_per_phase_per_video": {k: v / videos for k, v in phase_s.items()},
        "forwards_per_step": [s["counts"] for s in res["per_step"]],
        "minimum_forwards_per_step": [s["minimum"] for s in res["per_step"]],
        "peak_gib_by_phase": measured, "plan_phases_gib": pl["phases_gib"], "plan_terms_gib": pl["terms_gib"],
        "plan_comparison": rows,
        # the transformer's model FLOPs per second of each phase (sage_grpo.flops; medians of the timed steps) and
        # MFU against the datasheet's dense bf16 peak and against this card's measured bf16 matmul rate
        "peak_tflops": ck.peak_tflops(), "matmul_tflops": ck.matmul_tflops(),
        "utilisation": utilisation(res["median"]["tflops"], ck.peak_tflops(), ck.matmul_tflops()),
        # step 1 re-scores the rollout before any optimizer update: every ratio 1, to float32 rounding
        "first_update_ratio": {"min": first["ratio_min"], "max": first["ratio_max"], "approx_kl": first["approx_kl"],
                               **ratio_verdict(first["ratio_min"], first["ratio_max"])},
        "bench_step": res,
    }
    notes = [] if ck.device == "cuda" else [f"peak memory per phase: {NOT_MEASURED} (CPU)"]
    ck.write(stage, {f"plan_error/{r['phase']}": r["error"] for r in rows}, out, notes)
    return out


def depth_that_fits(ck: Check, flags: list[str], max_blocks: int) -> tuple[int, dict]:
    """The most double-stream blocks (<= max_blocks) whose plan for `flags` fits this GPU with --headroom_gib free."""
    from sage_grpo.errors import SageGRPOError

    argv = ck.post_train_argv(ck.ckpts / "plan", "plan", flags)  # the plan reads no files
    for blocks in range(max_blocks, 0, -1):
        pl = planned_phases(argv, ck.tcfg(blocks), frozen_parts(ck, blocks), ck.gpu_gib,
                            overhead_gib=ck.a.headroom_gib)
        if pl["fits"]:
            return blocks, pl
    raise SageGRPOError(f"by the plan not even one block of full fine-tuning fits {ck.gpu_gib:.1f} GiB")


def stage_lora(ck: Check) -> dict:
    return measured_run(ck, "lora", "lora", 2 if ck.tiny else 54, ck.lora_flags)


def stage_full(ck: Check) -> dict:
    blocks, pl = depth_that_fits(ck, FULL_FLAGS, 2 if ck.tiny else 54)
    out = measured_run(ck, "full", "full", blocks, FULL_FLAGS)
    print(f"[gpu_check] full fine-tuning: {blocks} blocks fit by the plan (peak {pl['peak_gib']:.1f} of "
          f"{ck.gpu_gib:.1f} GiB with {ck.a.headroom_gib:g} GiB headroom)")
    return out


def stage_compile(ck: Check) -> dict:
    from sage_grpo.models import compile as compiled_blocks

    blocks = 2 if ck.tiny else ck.a.compile_blocks
    compiled_blocks.DEFAULT_BACKEND = ck.a.compile_backend
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", "True"])):
        runs[name] = measured_run(ck, f"compile_{name}", "compile", blocks, [*ck.lora_flags, *extra])
    ratio = {k: runs["compiled"]["seconds_per_phase"][k] / v for k, v in runs["eager"]["seconds_per_phase"].items()
             if v and runs["compiled"]["seconds_per_phase"].get(k)}
    res = {"blocks": blocks, "backend": ck.a.compile_backend,
           "seconds_per_phase": {k: r["seconds_per_phase"] for k, r in runs.items()},
           "peak_gib_by_phase": {k: r["peak_gib_by_phase"] for k, r in runs.items()},
           "compiled_over_eager": ratio}
    ck.write("compile", {f"compiled_over_eager/{k}": v for k, v in ratio.items()}, res,
             ["timed steps exclude the first (it pays the compilation) when --steps > 1"])
    return res


def stage_recipes(ck: Check) -> dict:
    from sage_grpo.recipes import RECIPES, recipe_flags

    blocks = 2 if ck.tiny else ck.a.compile_blocks
    runs = {}
    for name in RECIPES:
        r = measured_run(ck, f"recipes_{name}", "compile", blocks,
                         [*ck.lora_flags, *recipe_flags(name, ck.a.sampling_steps)])
        steps = r["bench_step"]["per_step"]
        runs[name] = {
            "step_s": r["bench_step"]["median"]["step_s"],
            "forwards_per_sample_step": sum(s["counts"][k] for s in steps for k in ("rollout", "anchor", "update"))
            / (len(steps) * r["videos_per_step"]),
            "at_minimum": all(s["at_minimum"] for s in steps), "first_update_ratio": r["first_update_ratio"]["verdict"],
            "seconds_per_phase": r["seconds_per_phase"], "peak_gib_by_phase": r["peak_gib_by_phase"],
        }
    paper = runs["paper"]
    for r in runs.values():
        r["step_s_over_paper"] = r["step_s"] / paper["step_s"]
        r["forwards_over_paper"] = r["forwards_per_sample_step"] / paper["forwards_per_sample_step"]
    ratios = {f"{n}/{k}": r[k] for n, r in runs.items() for k in ("step_s_over_paper", "forwards_over_paper")}
    ck.write("recipes", ratios, {"blocks": blocks, "sampling_steps": ck.a.sampling_steps, "recipes": runs},
             ["timed steps exclude the first when --steps > 1"])
    return runs


def stage_bench_step(ck: Check) -> dict:
    import bench_step

    argv = ["--json", str(ck.out / "bench_step.json"), "--steps", str(ck.a.steps)]
    if ck.tiny:
        argv += ["--presets", "tiny", "--pipeline_repeats", "0"]
    else:
        argv += ["--device", "cuda", "--presets", "real", "--real_width", "--real_blocks", "2"]
    bench_step.main(argv)
    res = json.loads((ck.out / "bench_step.json").read_text())
    ck.write("bench_step", res["ratios"], {"bench_step_json": str(ck.out / "bench_step.json")}, [])
    return res


STAGE_FNS = {"build": stage_build, "attention": stage_attention, "memory": stage_memory, "lora": stage_lora,
             "full": stage_full, "compile": stage_compile, "recipes": stage_recipes, "bench_step": stage_bench_step}


# ------------------------------------------------------------------------------------------------ report


def _f(x, fmt="{:.2f}") -> str:
    return NOT_MEASURED if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def read_reports(out: Path) -> dict:
    """stage -> its report in `out` (the stages measured so far)."""
    return {stage: json.loads(p.read_text()) for stage in STAGES if (p := out / f"gpu_check_{stage}.json").exists()}


def host_line(reports: dict) -> str:
    """The machine of the reports (the first one's: a folder holds one machine's stages)."""
    first = next(iter(reports.values()))
    host = first["host"]
    return (f"GPU: {host.get('gpu') or NOT_MEASURED}; torch {host.get('torch')}, diffusers {host.get('diffusers')}"
            f"{' (--tiny: CPU, tiny model)' if first['results'].get('tiny') else ''}.")


def ratio_text(fr: dict) -> str:
    if fr.get("exact", fr["min"] == 1.0 == fr["max"]):  # reports written before "exact" was recorded: the same test
        return "exactly 1"
    return "not logged" if fr["min"] is None or fr["max"] is None else f"{fr['min']:.9g} to {fr['max']:.9g}"


def flops_cells(res: dict, phase: str) -> str:
    """'TFLOP/s | MFU (of the measured matmul rate)' of a run's phase: '-' for a phase without transformer work or
    that ran no forward ("not run"), NOT_MEASURED where the run measured none (the CPU, or a report without them)."""
    ran = all(row["verdict"] != "not run" for row in res.get("plan_comparison", []) if row["phase"] == phase)
    if phase not in ("rollout", "anchor", "update") or not ran:  # no transformer work, or no forward this time
        return "- | -"
    u = (res.get("utilisation") or {}).get(phase) or {}
    if u.get("tflops") is None:
        return f"{NOT_MEASURED} | {NOT_MEASURED}"
    mfu = NOT_MEASURED if u["mfu"] is None else f"{u['mfu']:.0%}"
    if u["of_matmul"] is not None:
        mfu += f" ({u['of_matmul']:.0%})"
    return f"{u['tflops']:.0f} | {mfu}"


def render_markdown(out: Path) -> str:
    """The tables of every stage report in `out`."""
    reports = read_reports(out)
    if not reports:
        return f"No stage measured yet: {NOT_MEASURED}."
    lines = [host_line(reports), ""]
    for stage in ("lora", "full"):
        r = reports.get(stage)
        if not r:
            continue
        res = r["results"]
        size = "x".join(map(str, res["geometry"]))
        fr = res["first_update_ratio"]
        ratio = ratio_text(fr)
        steps = len(res["forwards_per_step"])
        lines += [f"**{stage}** ({res['version']} {size}, {res['blocks']} blocks, {res['videos_per_step']} videos "
                  f"per step, {steps} step{'s' if steps > 1 else ''}; first update's ratio {ratio}: "
                  f"{fr['verdict']})", "",
                  f"bf16 matmul rate of this card: {_f(res.get('matmul_tflops'), '{:.0f}')} TFLOP/s measured, "
                  f"{_f(res.get('peak_tflops'), '{:g}')} on the datasheet (dense); MFU: the transformer's model "
                  "FLOPs per second against the datasheet's peak (against the measured rate)", "",
                  f"| phase | s per step | s per video | per-sample forwards (step {steps}) | TFLOP/s | MFU | peak GiB "
                  "| plan GiB | error | plan check |", "|---|---|---|---|---|---|---|---|---|---|"]
        last = res["forwards_per_step"][-1]
        for row in res["plan_comparison"]:
            ph = row["phase"]
            lines.append(f"| {ph} | {_f(res['seconds_per_phase'].get(ph))} | "
                         f"{_f(res['seconds_per_phase_per_video'].get(ph))} | {last.get(ph, '-')} | "
                         f"{flops_cells(res, ph)} | "
                         f"{_f(row['measured_gib'])} | {_f(row['planned_gib'])} | "
                         f"{'-' if row['verdict'] == 'not run' else _f(row['error'], '{:+.0%}')} | "
                         f"{row['verdict']} |")
        lines.append("")
    r = reports.get("compile")
    if r:
        res = r["results"]
        lines += [f"**compile** ({res['blocks']} blocks, backend {res['backend']}): seconds per step", "",
                  "| phase | eager | compiled | compiled / eager |", "|---|---|---|---|"]
        for ph, v in res["seconds_per_phase"]["eager"].items():
            c = res["seconds_per_phase"]["compiled"].get(ph)
            lines.append(f"| {ph} | {_f(v)} | {_f(c)} | {_f(res['compiled_over_eager'].get(ph))} |")
        lines.append("")
    r = reports.get("recipes")
    if r:
        res = r["results"]
        lines += [f"**recipes** (LoRA, {res['blocks']} blocks, T = {res['sampling_steps']})", "",
                  "| recipe | step s | vs paper | forwards / sample / step | vs paper | at minimum | first ratio |",
                  "|---|---|---|---|---|---|---|"]
        for name, x in res["recipes"].items():
            lines.append(f"| {name} | {_f(x['step_s'])} | {_f(x['step_s_over_paper'])} | "
                         f"{_f(x['forwards_per_sample_step'])} | {_f(x['forwards_over_paper'])} | {x['at_minimum']} | "
                         f"{x['first_update_ratio']} |")
        lines.append("")
    r = reports.get("build")
    if r:
        lines += ["**build** (bf16 parts resident on the device)", "", "| part | parameters | GiB | plan GiB | check |",
                  "|---|---|---|---|---|"]
        for row in r["results"]["parts"]:
            lines.append(f"| {row['part']} | {row['params']:,} | {_f(row['measured_gib'])} | "
                         f"{_f(row['planned_gib'])} | {row['verdict']} |")
        lines.append("")
    r = reports.get("attention")
    if r:
        v = r["results"]["verdicts"]
        verdicts = ", ".join(f"{k} {x}" for k, x in v.items())
        lines.append(f"**attention** valid-token vs diffusers' processor: {verdicts}")
    return "\n".join(lines)


def render_summary(out: Path) -> str:
    """README's block: one row per run measured in `out` (gpu_check.md holds the whole tables)."""
    reports = read_reports(out)
    res = {stage: r["results"] for stage, r in reports.items()}
    lines = [host_line(reports) if reports else f"GPU: {NOT_MEASURED}.", "",
             "| run | phase | s per video | TFLOP/s | MFU of the bf16 peak (of the measured matmul rate) | peak GiB "
             "| plan GiB | plan check |", "|---|---|---|---|---|---|---|---|"]
    for stage, name in (("lora", "LoRA"), ("full", "full fine-tuning")):
        r = res.get(stage)
        if r is None:
            lines.append(f"| {name} | {' / '.join(PHASE_MAP.values())} | " + " | ".join([NOT_MEASURED] * 6) + " |")
            continue
        per_video = r["seconds_per_phase_per_video"]
        cells = [[row["plan_phase"], _f(per_video.get(row["phase"]), "{:.1f}"),
                  *flops_cells(r, row["phase"]).split(" | "), _f(row["measured_gib"], "{:.1f}"),
                  _f(row["planned_gib"], "{:.1f}"), row["verdict"]] for row in r["plan_comparison"]]
        lines.append(f"| {name}, {r['version']} {'x'.join(map(str, r['geometry']))}, {r['blocks']} blocks | "
                     + " | ".join(" / ".join(column) for column in zip(*cells)) + " |")
    c = res.get("compile")
    depth = f", {c['blocks']} blocks" if c else ""
    lines.append(f"| `--compile` vs eager (LoRA{depth}) | seconds per phase, compiled / eager | "
                 + (", ".join(f"{k} {v:.2f}" for k, v in c["compiled_over_eager"].items()) if c else NOT_MEASURED)
                 + " | | | | | |")
    rc = res.get("recipes")
    lines.append("| cheaper-step recipes (LoRA) | step seconds / the paper recipe's | " + (
        ", ".join(f"{k} {x['step_s_over_paper']:.2f}" for k, x in rc["recipes"].items()) if rc else NOT_MEASURED)
        + " | | | | | |")
    ratios = [f"{name} {ratio_text(res[s]['first_update_ratio'])} ({res[s]['first_update_ratio']['verdict']})"
              for s, name in (("lora", "LoRA"), ("full", "full")) if s in res]
    lines.append(f"| first update's ratio (bf16, CUDA) | 1 to float32 rounding | "
                 f"{', '.join(ratios) or NOT_MEASURED} | | | | | |")
    a = res.get("attention")
    if a:
        b2 = next((x for x in a["bench_attention"]["rows"]
                   if (x["batch"], x["part"], x["impl"]) == (2, "block_ckpt", "ours")), None)
        speed = f"; CFG pair, fwd+bwd with checkpointing {b2['fwdbwd_ratio']:.2f} of diffusers' time" if b2 else ""
        att = ", ".join(f"{k} {v}" for k, v in a["verdicts"].items()) + speed
    lines.append("| valid-token vs diffusers' attention (bf16, real size) | equal to bf16 rounding | "
                 f"{att if a else NOT_MEASURED} | | | | | |")
    return "\n".join(lines)


def update_readme(text: str, readme: Path = ROOT / "README.md") -> None:
    from sage_grpo.errors import SageGRPOError

    body = readme.read_text()
    if README_BEGIN not in body or README_END not in body:
        raise SageGRPOError(f"{readme} has no {README_BEGIN} ... {README_END} block to fill")
    head, rest = body.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{text}\n{README_END}{tail}")


# ------------------------------------------------------------------------------------------------ main


def check_requirements() -> None:
    from sage_grpo.errors import SageGRPOError

    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        raise SageGRPOError(f"gpu_check needs {', '.join(missing)}: pip install -e '.[lora]' (on a machine without "
                            "an index, carry the wheels: pip download them elsewhere and pip install --no-index "
                            "--find-links DIR)")


def parse(argv=None):
    from sage_grpo.cli import CLIParser

    ap = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="all", help="comma list of stages or all: " + ", ".join(STAGES))
    ap.add_argument("--tiny", action="store_true", help="tiny random model on the CPU, same stages (the CPU test)")
    ap.add_argument("--version", default=DEFAULT_VERSION, help="checkpoint version measured (e.g. 480p_i2v, 720p_t2v, "
                    "720p_i2v): its transformer config, flow shift, CFG scale and size; I2V with SigLIP and 16:9 "
                    f"reference images (default {DEFAULT_VERSION}; with --model_path, that checkpoint's version)")
    ap.add_argument("--model_path", default="", help="diffusers-layout HunyuanVideo-1.5 with real weights (default: "
                    "random weights)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "outputs/gpu_check",
                    help="folder of the JSON reports and gpu_check.md (default $OUT or outputs/gpu_check)")
    ap.add_argument("--ckpt_dir", default="outputs/gpu_check/ckpt", help="random checkpoints and run folders")
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps per measured run (default 2)")
    ap.add_argument("--sampling_steps", type=int, default=None, help="T of the measured runs (default 8; 4 with "
                    "--tiny)")
    ap.add_argument("--tolerance", type=float, default=0.10, help="planner vs measured, relative (default 0.10)")
    ap.add_argument("--gpu_memory_gib", type=float, default=0.0, help="memory the full fine-tuning depth is planned "
                    "for (default: the GPU's; a nominal 16 on the CPU)")
    ap.add_argument("--headroom_gib", type=float, default=None, help="kept free when choosing that depth (default 4; "
                    "0 with --tiny)")
    ap.add_argument("--memory_cap_gib", type=float, default=0.0, help="cap the CUDA allocator at this many GiB "
                    "(torch.cuda.set_per_process_memory_fraction), as on a smaller card, and judge the plans against "
                    "it (e.g. 24; default 0: no cap; a no-op on the CPU)")
    ap.add_argument("--fp8_base", action="store_true", help="the LoRA runs (lora, compile, recipes) on an FP8 frozen "
                    "base (post_train.py --fp8_base True)")
    ap.add_argument("--compile_blocks", type=int, default=8, help="blocks of the compile stage's model (default 8)")
    ap.add_argument("--compile_backend", default="", help="torch.compile backend of the compile stage (default "
                    "inductor; eager with --tiny, which keeps the CPU check quick)")
    ap.add_argument("--peak_tflops", type=float, default=0.0, help="dense bf16 peak TFLOP/s of the card for MFU "
                    "(default: the datasheet figure of sage_grpo/flops.py's table; the measured matmul rate is "
                    "reported beside it)")
    ap.add_argument("--update_readme", action="store_true", help="write a summary of every stage measured in --out "
                    "into README.md's 'Measured on a GPU' block (the whole tables: gpu_check.md)")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    a.stages = list(STAGES) if a.stage == "all" else [s.strip() for s in a.stage.split(",") if s.strip()]
    for s in a.stages:
        if s not in STAGES:
            ap.error(f"unknown stage {s!r}; choose from {', '.join(STAGES)} or all")
    if a.sampling_steps is None:
        a.sampling_steps = 4 if a.tiny else 8
    if a.steps < 1 or a.sampling_steps < 1:
        ap.error("--steps and --sampling_steps must be >= 1")
    if a.memory_cap_gib < 0:
        ap.error("--memory_cap_gib must be >= 0 (0: no cap)")
    a.compile_backend = a.compile_backend or ("eager" if a.tiny else "inductor")
    if a.headroom_gib is None:
        a.headroom_gib = 0.0 if a.tiny else 4.0
    if a.tiny:
        a.ckpt_dir = a.ckpt_dir if a.ckpt_dir != "outputs/gpu_check/ckpt" else str(Path(a.out) / "ckpt")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    check_requirements()
    from sage_grpo.errors import SageGRPOError

    if a.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # init_distributed picks CUDA whenever it is there
    import torch

    from sage_grpo.cli import quiet_libraries

    if a.update_readme and a.tiny:
        raise SageGRPOError("--update_readme writes GPU figures; a --tiny run has none")
    if not a.tiny and not torch.cuda.is_available():
        raise SageGRPOError("no CUDA device: run on a GPU, or pass --tiny for the CPU check of this script")
    quiet_libraries()
    ck = Check(a)
    verdicts = {}
    for stage in a.stages:
        t0 = time.perf_counter()
        print(f"[gpu_check] {stage} ...", flush=True)
        res = STAGE_FNS[stage](ck)
        for key in ("plan_comparison",):
            for row in (res or {}).get(key, []) if isinstance(res, dict) else []:
                verdicts[f"{stage}/{row['phase']}"] = row["verdict"]
        if isinstance(res, dict) and "first_update_ratio" in res:
            verdicts[f"{stage}/first_update_ratio"] = res["first_update_ratio"]["verdict"]
        if stage == "attention":
            verdicts.update({f"attention/{k}": v for k, v in res.items()})
        if stage == "build":
            verdicts.update({f"build/{row['part']}": row["verdict"] for row in res["parts"]})
            verdicts["build/planner_count"] = "PASS" if res["planner_counts_transformer_exactly"] else "FAIL"
        print(f"[gpu_check] {stage} done in {time.perf_counter() - t0:.1f} s", flush=True)
    md = render_markdown(ck.out)
    print(md)
    if a.update_readme:
        update_readme(render_summary(ck.out))
    failed = sorted(k for k, v in verdicts.items() if v == "FAIL")
    print(f"[gpu_check] {len(verdicts)} checks: " + (f"FAIL {', '.join(failed)}" if failed else
                                                     "no FAIL") + f"; reports in {ck.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    from sage_grpo.errors import run_cli

    sys.exit(run_cli(main))
