#!/usr/bin/env python
"""Convert the authors' HunyuanVideo-1.5 checkpoint layout into a diffusers-layout directory (offline).

    python scripts/convert_authors_checkpoint.py --pretrained_model_root ckpts \\
        --out ckpts/HunyuanVideo-1.5-Diffusers-480p_t2v

Loading the authors' layout directly also works (the same key mapping runs at load time, see
sage_grpo/models/convert.py); converting once makes later loads faster and lets diffusers' own
HunyuanVideo15Pipeline.from_pretrained read the result. Weights are written in --dtype (default bf16).
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, check_writable_dir, quiet_libraries  # noqa: E402
from sage_grpo.config import DTYPES, Config  # noqa: E402
from sage_grpo.errors import run_cli  # noqa: E402


def check_out(root: Path, out: Path, version: str, overwrite: bool) -> bool:
    """Refuse an --out that would damage or mislabel a checkpoint, before anything is written; returns whether
    --out holds an earlier conversion to replace. Written into the authors' root itself, the conversion overwrites
    its vae/ and its model_index.json makes the root read as a diffusers layout, which load_pipeline then takes for
    every version (a later 480p_i2v or 720p_t2v run would silently get these weights); inside one of its folders it
    mixes into the authors' files, and as <root>/HunyuanVideo-1.5-Diffusers-<other version> it is found for that
    version. Paths are compared with symlinks resolved."""
    from sage_grpo.errors import SageGRPOError

    src, dst = root.resolve(), out.expanduser().resolve()
    own = src / f"HunyuanVideo-1.5-Diffusers-{version}"  # where load_pipeline looks for this version under the root
    if dst == src:
        raise SageGRPOError(f"--out {out} is the authors' checkpoint {src} itself: the conversion would overwrite its "
                            f"vae/ and turn it into a diffusers layout; choose {own} or a folder outside it")
    if dst.is_relative_to(src) and dst != own:
        raise SageGRPOError(f"--out {out} is inside the authors' checkpoint {src}, where it would mix into the "
                            f"authors' files or be taken for another version; choose {own} or a folder outside it")
    if not dst.is_dir() or not any(dst.iterdir()):
        return False
    if not (dst / "model_index.json").is_file():
        raise SageGRPOError(f"--out {out} is not empty and holds no earlier conversion (no model_index.json); "
                            "choose a new or empty folder")
    if not overwrite:
        raise SageGRPOError(f"--out {out} already holds a converted checkpoint; pass --overwrite to replace it, or "
                            "choose a new folder")
    return True


def main(argv: list[str] | None = None) -> None:
    m = Config().model  # the training flags' defaults
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrained_model_root", default=m.pretrained_model_root,
                   help="the authors' layout root (default: %(default)s)")
    p.add_argument("--pretrained_transformer_version", default=m.pretrained_transformer_version,
                   help="sub-folder of <root>/transformer to convert (default: %(default)s)")
    p.add_argument("--out", required=True, help="output directory (diffusers layout): a new or empty folder "
                                                "outside the authors' root, or <root>/HunyuanVideo-1.5-Diffusers-"
                                                "<version> of the converted version")
    p.add_argument("--overwrite", action="store_true", help="replace the earlier conversion that --out holds "
                                                            "(a folder with model_index.json): its files are removed "
                                                            "first")
    p.add_argument("--dtype", default=m.dtype, choices=DTYPES, help="dtype of the written weights (default: "
                                                                    "%(default)s)")
    p.add_argument("--verbose", action="store_true", help="show the libraries' warnings and progress bars")
    a = p.parse_args(argv)

    from sage_grpo.errors import SageGRPOError
    from sage_grpo.files import usual_permissions
    from sage_grpo.models.loading import load_pipeline, locate_model
    from sage_grpo.models.tiny import TEXT_LENGTHS_FILE

    t0 = time.time()
    loc = locate_model(a.pretrained_model_root, "", a.pretrained_transformer_version)
    if loc.layout != "authors":
        raise SageGRPOError(f"{loc.root} is already in the diffusers layout")
    replace = check_out(loc.root, Path(a.out), loc.version, a.overwrite)
    check_writable_dir(a.out, "--out")  # before minutes of loading
    quiet_libraries(a.verbose)
    pipe = load_pipeline(a.pretrained_model_root, "", a.pretrained_transformer_version, dtype=a.dtype)
    out = Path(a.out)
    if replace:  # the earlier conversion's files go: a stale shard or component would be read beside the new ones
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    pipe.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    for f in out.rglob("*.safetensors"):  # safetensors writes 0600; converted weights are for every user of ckpts/
        usual_permissions(f)
    src = loc.root / TEXT_LENGTHS_FILE  # tiny checkpoints only: keep their text lengths
    if src.is_file():
        (out / TEXT_LENGTHS_FILE).write_text(src.read_text())
    (out / "converted_from.json").write_text(json.dumps({"root": str(loc.root), "version": loc.version}) + "\n")
    print(f"converted {loc.root} ({loc.version}) -> {out} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    run_cli(main)
