#!/usr/bin/env python
"""Export a training checkpoint's transformer as a diffusers model directory (config.json + safetensors) that
`HunyuanVideo15Transformer3DModel.from_pretrained` loads, e.g. to swap into a diffusers-layout model folder.

    python scripts/export_checkpoint.py --checkpoint outputs/run/checkpoint-500 --out exported/transformer
    python scripts/export_checkpoint.py --checkpoint outputs/lora_run/checkpoint-500 --out exported/t --merge_lora False

checkpoint-N/transformer holds the trained weights under the plain model's names (for a LoRA run the adapter is
already merged into them). With --merge_lora False a LoRA run's base weights are exported unmerged and the adapter
(lora/adapter_model.safetensors + adapter_config.json) is copied beside them as lora/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, check_writable_dir  # noqa: E402
from sage_grpo.config import parse_bool  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402
from sage_grpo.files import usual_permissions  # noqa: E402


def main(argv=None) -> Path:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="output_dir/checkpoint-N of post_train.py")
    p.add_argument("--out", required=True, help="directory to write (created; must be empty or absent)")
    p.add_argument("--merge_lora", default="True", help="LoRA runs: export merged weights (True) or base + adapter")
    p.add_argument("--dtype", default="", choices=["", "fp32", "bf16", "fp16"],
                   help="dtype of the exported weights; default: the checkpoint's master weight type")
    args = p.parse_args(argv)
    merge = parse_bool(args.merge_lora, "--merge_lora")
    ckpt, out = Path(args.checkpoint), Path(args.out)
    state_file = ckpt / "train_state.json"
    if not state_file.is_file():
        raise SageGRPOError(f"--checkpoint {args.checkpoint!r} is not a complete post_train.py checkpoint (no train_state.json)")
    if out.exists() and any(out.iterdir()):
        raise SageGRPOError(f"--out {args.out!r} exists and is not empty; choose a new directory")
    check_writable_dir(out.parent, "--out")
    cfg = json.loads(state_file.read_text())["config"]
    m = cfg["model"]

    from sage_grpo.config import torch_dtype
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.lora import load_dcp_transformer

    dtype = torch_dtype(args.dtype or m["master_weight_type"])
    pipe = load_pipeline(m["pretrained_model_root"], m["model_path"], m["pretrained_transformer_version"],
                         dtype=dtype, load_text_encoders=False)
    lora = ckpt / "lora"
    if merge or not lora.is_dir():
        load_dcp_transformer(pipe.transformer, ckpt / "transformer")
    # written beside the target and renamed when complete: an interrupted export leaves no half-written --out
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.transformer.save_pretrained(tmp, safe_serialization=True)
    if not merge and lora.is_dir():
        shutil.copytree(lora, tmp / "lora")
    usual_permissions(tmp)  # safetensors writes 0600: an export is for others to read
    if out.exists():
        out.rmdir()  # empty (checked above)
    tmp.rename(out)
    print(f"[export] {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
