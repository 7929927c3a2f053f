"""The README.md model card `scripts/export_checkpoint.py` writes into its export folder: a YAML metadata block the
Hugging Face hub reads (base_model, base_model_relation, library_name, pipeline_tag, tags), then the method, the
reward and its weights, the training steps and key flags (from the checkpoint's train_state.json config), the
validation metrics of the exported step (from the run's metrics.jsonl when present) and how to load the weights.

Only the train_state.json config is read, through `.get` with the flags shown only when present, so a checkpoint
of an older or newer config still gets a card. `task` (train_state.json's "task", written since image-to-video
runs exist; "t2v" when absent) picks the pipeline class, the hub tag and the --image in the usage lines. A run of
another model than HunyuanVideo-1.5's (a tiny test model, the world model; `released_base` reads its transformer
config, no weights) names its own folder as the base, and no hub base_model."""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["model_card", "validation_metrics", "base_model_id", "released_base"]

AUTHORS_REPO = "tencent/HunyuanVideo-1.5"
DIFFUSERS_REPO = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{version}"

# (config group, key) pairs shown as "key flags"
KEY_FLAGS = [
    ("rollout", "sde_type"), ("rollout", "eta"), ("rollout", "grpo_sampling_steps"), ("rollout", "flow_shift"),
    ("rollout", "cfg_scale"), ("rollout", "sample_n_frames"), ("rollout", "height"), ("rollout", "width"),
    ("data", "num_generations"), ("data", "batch_size"),
    ("optim", "learning_rate"), ("optim", "use_muon"), ("optim", "clip_range"), ("optim", "use_grad_balancing"),
    ("optim", "enable_timestep_permutation"), ("optim", "timestep_fraction"),
    ("kl", "use_dual_kl"), ("kl", "use_moving_KL"), ("kl", "kl_weight"), ("kl", "kl_adapt_direction"),
    ("kl", "dual_kl_moving_weight"), ("kl", "dual_kl_step_weight"),
    ("model", "use_lora"), ("model", "lora_r"), ("model", "lora_alpha"), ("model", "lora_target_modules"),
]


def base_model_id(config: dict, layout: str, task: str = "t2v") -> str:
    """The hub id of the base weights: the authors' repo, or the community diffusers conversion of the version. A
    diffusers-layout run names no version (its --pretrained_transformer_version keeps the default 480p_t2v): when
    the version's task is not the run's, the same version of the run's task is named."""
    version = config.get("model", {}).get("pretrained_transformer_version") or "480p_t2v"
    if task == "i2v" and "i2v" not in version:
        version = version.replace("t2v", "i2v")
    elif task == "t2v" and "i2v" in version:
        version = version.replace("i2v", "t2v")
    return DIFFUSERS_REPO.format(version=version) if layout == "diffusers" else AUTHORS_REPO


def card_base(folder: str | Path) -> dict[str, str]:
    """The base model an exported folder's README.md (written by `model_card`) names, as generate.py's base flags:
    the community diffusers conversion -> {"pretrained_transformer_version": its version} (found under
    --pretrained_model_root, where download_weights.sh puts it), the model at a folder (not the released one) ->
    {"model_path": that folder}; {} when the card names none (or the authors' repository: the default root)."""
    import re

    card = Path(folder) / "README.md"
    text = card.read_text(errors="replace") if card.is_file() else ""
    hub = re.search(r"^base_model: (\S+)$", text, re.M)
    if hub:
        version = re.fullmatch(re.escape(DIFFUSERS_REPO).replace(re.escape("{version}"), r"(\w+)"), hub[1])
        return {"pretrained_transformer_version": version[1]} if version else {}
    local = re.search(r"Post-trained from the model at `([^`]+)`", text)
    return {"model_path": local[1]} if local and local[1] != "?" else {}


# the transformer config keys that tell HunyuanVideo-1.5's released architecture from a smaller model
ARCHITECTURE_KEYS = ("num_layers", "num_refiner_layers", "num_attention_heads", "attention_head_dim", "text_embed_dim")


def released_base(config: dict) -> bool:
    """Whether the run's model (its config's --model_path / --pretrained_model_root) has the architecture of the
    released HunyuanVideo-1.5 (its transformer config.json against sage_grpo.models.full_size's), so that the hub
    repository may be named as its base. A model that cannot be found or read is not claimed to be it."""
    from sage_grpo.errors import SageGRPOError
    from sage_grpo.models.full_size import real_transformer_config
    from sage_grpo.models.loading import locate_model

    m = config.get("model", {})
    version = m.get("pretrained_transformer_version") or "480p_t2v"
    try:
        loc = locate_model(m.get("pretrained_model_root", "ckpts"), m.get("model_path", ""), version)
        folder = loc.root / "transformer" / (version if loc.layout == "authors" else "")
        found = json.loads((folder / "config.json").read_text())
        real = real_transformer_config(version)
    except (SageGRPOError, OSError, ValueError):
        return False
    return all(found.get(k, real[k]) == real[k] for k in ARCHITECTURE_KEYS)


def validation_metrics(metrics_file: Path, step: int) -> tuple[int, dict[str, float]] | None:
    """The last record at or before `step` with `val/` metrics -> (its step, {name: value}); None without any."""
    if not metrics_file.is_file():
        return None
    found = None
    for line in metrics_file.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a crash: the rest of the file still counts
            continue
        vals = {k: v for k, v in rec.items() if k.startswith("val/") and isinstance(v, int | float)}
        if vals and rec.get("step", math.inf) <= step:
            found = (int(rec["step"]), vals)
    return found


def _reward_lines(reward: dict) -> list[str]:
    name = reward.get("reward_model", "?")
    lines = [f"- Reward: `{name}`"]
    weights = reward.get("reward_weights")
    if weights:
        try:
            parsed = json.loads(weights) if isinstance(weights, str) else weights
            shown = ", ".join(f"{k} {v:g}" if isinstance(v, int | float) else f"{k} {v}" for k, v in parsed.items())
        except (ValueError, AttributeError):
            shown = str(weights)
        lines.append(f"- Reward weights: {shown}")
    return lines


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return ", ".join(map(str, v)) if v else "(default: every linear of the transformer blocks)"
    return str(v)


def model_card(config: dict, *, step: int, kind: str, files: list[str], metrics_file: Path | None = None,
               lora_settings: dict | None = None, task: str = "t2v", released: bool = True) -> str:
    """README.md text. kind: "merged" (a diffusers transformer folder) or a LoRA layout of
    sage_grpo.models.lora_formats (peft, diffusers, original, comfy). released: the run's model is HunyuanVideo-1.5's
    released architecture (`released_base`); else its folder is named as the base, and no hub repository."""
    is_lora = kind != "merged"
    layout = "authors" if kind in ("original", "comfy") else "diffusers"
    m = config.get("model", {})
    base = base_model_id(config, layout, task) if released else (m.get("model_path") or
                                                                 m.get("pretrained_model_root") or "?")
    tag = "image-to-video" if task == "i2v" else "text-to-video"
    optim = config.get("optim", {})
    tags = [tag, "hunyuanvideo-1.5", "grpo", "sage-grpo", "reinforcement-learning"]
    if is_lora:
        tags += ["lora"] + (["comfyui"] if kind == "comfy" else [])
    library = "peft" if kind == "peft" else "diffusers"
    meta = [
        "---",
        *([f"base_model: {base}", f"base_model_relation: {'adapter' if is_lora else 'finetune'}"] if released else []),
        f"library_name: {library}",
        f"pipeline_tag: {tag}",
        "tags:",
        *[f"- {t}" for t in tags],
        "---",
    ]
    what = f"LoRA ({kind} layout)" if is_lora else "fine-tuned transformer (diffusers layout, LoRA merged if any)"
    out = [*meta, "", f"# HunyuanVideo-1.5 SAGE-GRPO {what}, step {step}", ""]
    source = (f"[{base}](https://huggingface.co/{base})" if released else
              f"the model at `{base}` (not HunyuanVideo-1.5's released model: its transformer config has another "
              "architecture, e.g. a tiny test model, or was not found at export)")
    out += [
        f"Post-trained from {source} with SAGE-GRPO (\"Manifold-Aware Exploration for "
        "Reinforcement Learning in Video Generation\", arXiv 2603.21872): GRPO with a manifold-aware SDE for the "
        "rollouts, a gradient-norm equalizer and a dual trust region (KL to a moving anchor and step-wise).",
        "",
        "## Training",
        "",
        f"- Steps: {step} of {optim.get('max_steps', '?')}",
        *_reward_lines(config.get("reward", {})),
    ]
    if lora_settings:
        out.append(f"- LoRA: r {lora_settings['r']}, alpha {_fmt(lora_settings['lora_alpha'])}, "
                   f"{len(lora_settings['target_modules'])} target modules")
    if m.get("use_lora") and m.get("fp8_base"):
        out.append(_fp8_line(kind, files, bool(m.get("fp8_matmul"))))
    out += ["", "Key flags (from the checkpoint's train_state.json):", "", "| flag | value |", "|---|---|"]
    for group, key in KEY_FLAGS:
        if key in config.get(group, {}):
            out.append(f"| `--{key}` | {_fmt(config[group][key])} |")
    out += ["", "## Validation", ""]
    val = validation_metrics(metrics_file, step) if metrics_file is not None else None
    if val is None:
        out.append("No validation metrics were recorded up to this step (metrics.jsonl has no `val/` entries).")
    else:
        vstep, vals = val
        out += [f"At step {vstep} (metrics.jsonl):", "", "| metric | value |", "|---|---|"]
        out += [f"| {k} | {v:.6g} |" for k, v in sorted(vals.items())]
    out += ["", "## Files", "", *[f"- `{f}`" for f in files], "", "## How to load", ""]
    out += _how_to_load(kind, files, base, task, released)
    return "\n".join(out) + "\n"


def _fp8_line(kind: str, files: list[str], fp8_matmul: bool) -> str:
    """What an --fp8_base run's export is: the run trained its adapter beside the FP8 quantization Q(W) of the base,
    so the trained model is Q(W) + BA; the released weights with the adapter, W + BA, differ from it by the base's
    quantization error (scripts/export_checkpoint.py merges into the dequantized Q(W))."""
    line = ("- FP8 base (`--fp8_base`): the adapter was trained beside the FP8 quantization of the base's "
            "transformer-block linears (float8_e4m3fn, one scale per output channel). ")
    if kind == "merged":
        beside = any(f.startswith("lora/") for f in files)
        line += ("These base weights are that FP8 base dequantized, "
                 + ("the adapter beside them in `lora/`" if beside else "with the adapter merged")
                 + ": the model the run trained and validated (the adapter on the unquantized base weights gives "
                 "another model, by the base's quantization error).")
    else:
        line += ("On the unquantized base weights it gives another model than the trained one (by the base's "
                 "quantization error): `generate.py --fp8_base True` runs the trained one, and "
                 "`scripts/export_checkpoint.py` without `--lora_format` merges it into the dequantized FP8 base.")
    if fp8_matmul:
        line += " The run's `--fp8_matmul` also quantized the activations per row, which no weights hold."
    return line


def _how_to_load(kind: str, files: list[str], base: str, task: str = "t2v", released: bool = True) -> list[str]:
    weights = next((f for f in files if f.endswith(".safetensors")), "")
    cls = "HunyuanVideo15ImageToVideoPipeline" if task == "i2v" else "HunyuanVideo15Pipeline"
    if kind == "merged":
        return ["diffusers (replace the transformer of the base pipeline):", "", "```python",
                "import torch", f"from diffusers import {cls}, HunyuanVideo15Transformer3DModel",
                "transformer = HunyuanVideo15Transformer3DModel.from_pretrained(\"<this folder>\", "
                "torch_dtype=torch.bfloat16)",
                f"pipe = {cls}.from_pretrained(\"{base}\", transformer=transformer, "
                "torch_dtype=torch.bfloat16)", "```"]
    lines = []
    if kind in ("diffusers", "peft"):
        diffusers_base = base
        prefix = "transformer" if kind == "diffusers" else "base_model.model"
        lines += [f"diffusers (0.42's {cls} has no `load_lora_weights`; load into the transformer):",
                  "", "```python", "import torch", f"from diffusers import {cls}",
                  f"pipe = {cls}.from_pretrained(\"{diffusers_base}\", torch_dtype=torch.bfloat16)"]
        if kind == "diffusers":
            lines.append(f"pipe.transformer.load_lora_adapter(\"<this folder>\", weight_name=\"{weights}\", "
                         f"prefix=\"{prefix}\", adapter_name=\"sage_grpo\")")
        else:
            lines += ["from peft import PeftModel",
                      "pipe.transformer = PeftModel.from_pretrained(pipe.transformer, \"<this folder>\")"
                      ".merge_and_unload()"]
        lines += ["```", ""]
    if kind == "comfy":
        lines += ["ComfyUI: copy the file into `ComfyUI/models/loras/` and apply it to the HunyuanVideo-1.5 model with "
                  "a `LoraLoaderModelOnly` node. The keys are ComfyUI's own module names "
                  "(`diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight`, per-module `.alpha`): ComfyUI's "
                  "model fuses each block's q, k, v into one linear, so their three LoRAs are one exact LoRA here.",
                  ""]
    if kind == "original":
        lines += ["The keys are the authors' module names (`double_blocks.0.img_attn_q.lora_A.weight`, per-module "
                  "`.alpha`), for tools that read the original checkpoint's names; for ComfyUI export "
                  "`--lora_format comfy`.", ""]
    lines += ["This repository (any of the four layouts; detected from the keys):", "", "```bash",
              f"python generate.py {'--pretrained_model_root ckpts' if released else '--model_path ' + base} "
              "--lora_path <this folder> --prompt \"...\""
              + (" --image first_frame.png" if task == "i2v" else ""), "```"]
    return lines
