#!/usr/bin/env python
"""Export a training checkpoint: the transformer as a diffusers model directory (config.json + safetensors) that
`HunyuanVideo15Transformer3DModel.from_pretrained` loads, or (--lora_format) a LoRA run's adapter alone in the key
layout another tool reads. Every export folder gets a README.md model card (hub metadata, method, reward, steps,
key flags, validation metrics, how to load).

    python scripts/export_checkpoint.py --checkpoint outputs/run/checkpoint-500 --out exported/transformer
    python scripts/export_checkpoint.py --checkpoint outputs/lora_run/checkpoint-500 --out exported/t --merge_lora False
    python scripts/export_checkpoint.py --checkpoint outputs/lora_run/checkpoint-500 --out exported/comfy \
        --lora_format comfy     # peft | diffusers | original | comfy (see sage_grpo/models/lora_formats.py)

A full fine-tuning checkpoint-N/transformer holds the trained weights under the plain model's names; a LoRA run's
checkpoint holds the adapter alone (checkpoint-N/lora), which the weights export merges into the run's base weights
(--model_path of its config). With --merge_lora False a LoRA run's base weights are exported unmerged and the
adapter (lora/adapter_model.safetensors + adapter_config.json) is copied beside them as lora/. The base weights of
an --fp8_base run are its FP8 base dequantized (the weights it trained the adapter beside), not the unquantized ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, check_writable_dir, quiet_libraries  # noqa: E402
from sage_grpo.config import parse_bool  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402
from sage_grpo.files import usual_permissions  # noqa: E402
from sage_grpo.models.lora_formats import FORMATS, from_peft, write_lora  # noqa: E402
from sage_grpo.models.model_card import base_model_id, model_card, released_base  # noqa: E402


def main(argv=None) -> Path:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="output_dir/checkpoint-N of post_train.py")
    p.add_argument("--out", required=True, help="directory to write (created; must be empty or absent)")
    p.add_argument("--merge_lora", default=None, help="LoRA runs: export merged weights (True, default) or base + "
                   "adapter")
    p.add_argument("--lora_format", default="", metavar="{" + ",".join(FORMATS) + "}",
                   help="LoRA runs: write only the adapter, with diffusers/peft keys (peft: adapter_model.safetensors "
                   "+ adapter_config.json; diffusers: pytorch_lora_weights.safetensors for load_lora_adapter), the "
                   "original HunyuanVideo-1.5 keys (original) or ComfyUI's (comfy); no model is loaded")
    p.add_argument("--dtype", default="", choices=["", "fp32", "bf16", "fp16"],
                   help="dtype of the exported weights; default: the checkpoint's master weight type")
    p.add_argument("--verbose", action="store_true", help="show the libraries' warnings (hidden by default, as in "
                   "post_train.py and generate.py)")
    args = p.parse_args(argv)
    quiet_libraries(args.verbose)
    if args.lora_format and args.lora_format not in FORMATS:
        raise SageGRPOError(f"--lora_format {args.lora_format!r} is not one of {', '.join(FORMATS)}")
    if args.lora_format and args.merge_lora is not None:
        raise SageGRPOError("--merge_lora applies to the weights export; --lora_format writes the adapter alone")
    merge = parse_bool(args.merge_lora if args.merge_lora is not None else "True", "--merge_lora")
    ckpt, out = Path(args.checkpoint), Path(args.out)
    state_file = ckpt / "train_state.json"
    if not ckpt.exists():
        raise SageGRPOError(f"--checkpoint {args.checkpoint!r} does not exist: pass a post_train.py run's "
                            "output_dir/checkpoint-N")
    if not state_file.is_file():
        raise SageGRPOError(f"--checkpoint {args.checkpoint!r} is not a complete post_train.py checkpoint (no "
                            "train_state.json)")
    if out.exists() and any(out.iterdir()):
        raise SageGRPOError(f"--out {args.out!r} exists and is not empty; choose a new directory")
    check_writable_dir(out.parent, "--out")
    train_state = json.loads(state_file.read_text())
    cfg = train_state["config"]
    m = cfg["model"]
    step = int(train_state.get("step", 0))
    metrics = ckpt.parent / "metrics.jsonl"  # the run's output_dir holds it
    lora = ckpt / "lora"
    if args.lora_format:
        if not lora.is_dir():
            raise SageGRPOError(f"--lora_format {args.lora_format}: {args.checkpoint!r} is a full fine-tuning "
                                "checkpoint (no lora/ adapter); export its weights without --lora_format")
        return _export_lora(lora, out, args.lora_format, args.dtype, cfg, step, metrics, train_state.get("task", "t2v"),
                            released_base(cfg))

    from sage_grpo.checkpoint import run_base
    from sage_grpo.config import torch_dtype
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.lora import load_dcp_transformer, merge_adapter

    dtype = torch_dtype(args.dtype or m["master_weight_type"])
    # an --fp8_base run trained, rolled out and validated its adapter beside Q(W), the FP8 quantization of its base
    # loaded in the compute dtype (post_train.load_policy): the base exported is that one, dequantized (the weights
    # its layers computed with), so that the export is the model the run trained; W + BA would be another model
    fp8 = lora.is_dir() and bool(m.get("fp8_base", False))
    pipe = load_pipeline(*run_base(train_state), dtype=torch_dtype(m["dtype"]) if fp8 else dtype,
                         load_text_encoders=False)
    if fp8:
        from sage_grpo.models.fp8 import dequantize_base, quantize_base

        quantize_base(pipe.transformer, "cpu")  # the bytes of either FP8 config (sage_grpo.models.fp8.quantize_rows)
        dequantize_base(pipe.transformer)
        pipe.transformer.to(dtype)
        print(f"[export] {ckpt}: an --fp8_base run: its adapter {'merged into' if merge else 'beside'} the FP8 base "
              "dequantized (Q(W) + BA, the model it trained), not the unquantized base weights (W + BA)"
              + ("; the run's --fp8_matmul also quantized the activations, which no weights hold" if
                 m.get("fp8_matmul") else ""), flush=True)
    if not lora.is_dir():
        load_dcp_transformer(pipe.transformer, ckpt / "transformer")
    elif merge:  # a LoRA checkpoint holds the adapter only: merged into the run's base weights here
        merge_adapter(pipe.transformer, lora)
    # written beside the target and renamed when complete: an interrupted export leaves no half-written --out
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.transformer.save_pretrained(tmp, safe_serialization=True)
    if not merge and lora.is_dir():
        shutil.copytree(lora, tmp / "lora")
    files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
    (tmp / "README.md").write_text(model_card(cfg, step=step, kind="merged", files=files, metrics_file=metrics,
                                              task=train_state.get("task", "t2v"), released=released_base(cfg)))
    return _commit(tmp, out)


def _export_lora(lora_dir: Path, out: Path, fmt: str, dtype: str, cfg: dict, step: int, metrics: Path,
                 task: str = "t2v", released: bool = True) -> Path:
    """The adapter of checkpoint-N/lora, converted by sage_grpo.models.lora_formats (tensors only: no model).
    released: the run's model is HunyuanVideo-1.5's released architecture (the card names the hub base)."""
    from sage_grpo.config import torch_dtype
    from sage_grpo.models.lora import read_adapter, saved_lora_settings

    settings = saved_lora_settings(lora_dir)
    if settings is None:
        raise SageGRPOError(f"{lora_dir} has no adapter_config.json: the LoRA scale (alpha / r) is unknown")
    _, state = read_adapter(lora_dir)
    if dtype:
        state = {k: v.to(torch_dtype(dtype)) for k, v in state.items()}
    adapter = from_peft(state, settings)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    path = write_lora(adapter, tmp, fmt, base_model=base_model_id(cfg, "diffusers", task) if released else "")
    files = sorted(f.name for f in tmp.iterdir())
    (tmp / "README.md").write_text(model_card(cfg, step=step, kind=fmt, files=files, metrics_file=metrics,
                                              lora_settings=settings, task=task, released=released))
    out = _commit(tmp, out)
    print(f"[export] {out / path.name} ({fmt} layout)")
    return out


def _commit(tmp: Path, out: Path) -> Path:
    usual_permissions(tmp)  # safetensors writes 0600: an export is for others to read
    if out.exists():
        out.rmdir()  # empty (checked above)
    tmp.rename(out)
    print(f"[export] {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
