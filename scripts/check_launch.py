#!/usr/bin/env python
"""The launchers' preflight: post_train.py's checks for the world size the launch will have, in one process, before
torchrun spawns a worker. A user error (missing config, impossible geometry, bad prompt file, missing checkpoint)
is then one `error:` line and exit 2, not one copy per rank and torchrun's traceback.

    python scripts/check_launch.py --nnodes 8 --nproc_per_node 8 --config configs/multinode_64gpu.yaml [flags...]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from sage_grpo.config import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 add_help=True)
    ap.add_argument("--nnodes", type=int, required=True, help="nodes of the launch")
    ap.add_argument("--nproc_per_node", type=int, required=True, help="processes per node")
    known, rest = ap.parse_known_args(argv)
    if known.nnodes < 1 or known.nproc_per_node < 1:
        ap.error("--nnodes and --nproc_per_node must be >= 1")
    spec = importlib.util.spec_from_file_location("post_train", ROOT / "post_train.py")
    pt = importlib.util.module_from_spec(spec)
    sys.modules["post_train"] = pt  # dataclasses look their module up there
    spec.loader.exec_module(pt)
    cfg = load_config(rest, prog="post_train.py")
    from sage_grpo.cli import quiet_libraries

    quiet_libraries(cfg.logging.verbose)  # as post_train.py before its preflight: reading a checkpoint's guider
    # config makes diffusers warn "Guiders are ... experimental"
    pt.preflight(cfg, known.nnodes * known.nproc_per_node, known.nproc_per_node)
    return 0


if __name__ == "__main__":
    from sage_grpo.errors import run_cli

    sys.exit(run_cli(main))
