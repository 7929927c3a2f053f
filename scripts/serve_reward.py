#!/usr/bin/env python
"""Serve a reward over HTTP for `--reward_model remote --reward_url http://HOST:PORT` (docs/rewards.md).

    SAGE_REWARD_TOKEN=secret CUDA_VISIBLE_DEVICES=7 python scripts/serve_reward.py --reward_model videoalign_local \
        --pretrained_model_root ckpts --device cuda --port 8000

Any reward the trainer takes is served: a registered name, an import path (`package.module:factory`,
`path/to/file.py:factory`) or several joined by commas. The reward flags are the training flags without the
`reward_` prefix, with the same defaults; the trainer's --reward_weights apply on the trainer's side. Concurrent
requests are batched (up to --max_batch videos); a request body over --max_request_mb is refused. /health needs no
token, /info and /score need `Authorization: Bearer $SAGE_REWARD_TOKEN` when that variable is set; a --host other
than loopback is refused without it, unless --allow_unauthenticated. Needs `pip install 'sage-grpo[serve]'`.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import os
import socket
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.config import DTYPES, Config  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402
from sage_grpo.rewards.remote import MAX_BODY_BYTES, TOKEN_ENV  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    r, m = Config().reward, Config().model
    ap = argparse.ArgumentParser(prog="serve_reward.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reward_model", required=True, help="reward name(s) or import path(s), comma-separated")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for other hosts, which needs "
                                                        "SAGE_REWARD_TOKEN (default: %(default)s)")
    ap.add_argument("--allow_unauthenticated", action="store_true",
                    help="serve a --host other than loopback without SAGE_REWARD_TOKEN, on purpose: whoever reaches "
                         "the port can then use the reward")
    ap.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu", help="(default: %(default)s)")
    ap.add_argument("--dtype", default=r.reward_dtype, choices=DTYPES, help="reward model dtype (default: %(default)s)")
    ap.add_argument("--pretrained_model_root", default=m.pretrained_model_root, help="(default: %(default)s)")
    ap.add_argument("--model_path", default="", help="VideoReward directory (default <root>/VideoReward)")
    ap.add_argument("--base_model_path", default="", help="Qwen2-VL-2B-Instruct directory (default <root>/...)")
    ap.add_argument("--checkpoint_mode", default=r.reward_checkpoint_mode, choices=("v1", "v2", "v3"))
    ap.add_argument("--checkpoint_step", type=int, default=r.reward_checkpoint_step)
    ap.add_argument("--max_pixels", type=int, default=r.reward_max_pixels)
    ap.add_argument("--min_pixels", type=int, default=r.reward_min_pixels)
    ap.add_argument("--sample_fps", type=float, default=r.reward_sample_fps)
    ap.add_argument("--video_fps", type=float, default=Config().rollout.video_fps,
                    help="frame rate of the trainer's videos (default: %(default)s)")
    ap.add_argument("--batch_size", type=int, default=r.reward_batch_size, help="videos per reward forward; 0 = all")
    ap.add_argument("--clip_model_path", default=r.clip_model_path)
    ap.add_argument("--pickscore_model_path", default=r.pickscore_model_path)
    ap.add_argument("--pickscore_processor_path", default=r.pickscore_processor_path)
    ap.add_argument("--max_batch", type=int, default=16, help="most videos scored together across concurrent "
                                                               "requests (default: %(default)s)")
    ap.add_argument("--batch_wait_ms", type=float, default=10.0, help="how long the first request of a batch waits "
                                                                      "for others (default: %(default)s)")
    ap.add_argument("--max_request_mb", type=int, default=MAX_BODY_BYTES >> 20,
                    help="largest request body in MiB, compressed and decoded (decompressed, plus uint8 frames as "
                         "float32): a longer one is refused (413) before it is read (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    return ap


def own_flags(message: str) -> str:
    """A reward's error in this command's words: the training flag `--reward_X` it names becomes this server's
    `--X` (`--reward_model_path` -> `--model_path`), where the server has that flag and not the training one."""
    import re

    flags = {f for a in build_parser()._actions for f in a.option_strings}

    def own(m: re.Match) -> str:
        flag, short = m[0], "--" + m[1]
        return short if flag not in flags and short in flags else flag

    return re.sub(r"--reward_(\w+)", own, message)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# the flags that change the scores a reward gives (device, batching and threads do not): servers of one reward
# are replicas only when these are equal too
SETTINGS = ("pretrained_model_root", "model_path", "base_model_path", "checkpoint_mode", "checkpoint_step", "dtype",
            "max_pixels", "min_pixels", "sample_fps", "video_fps", "clip_model_path", "pickscore_model_path",
            "pickscore_processor_path")


def reward_version(spec: str, reward) -> str:
    """The reward's own `version` when it has one; a user's file: the hash of its text (a changed file is a
    different reward); else the package version."""
    own = getattr(reward, "version", None)
    if own:
        return str(own)
    try:
        pkg = version("sage-grpo")
    except PackageNotFoundError:
        pkg = "unknown"
    parts = [f"sage-grpo {pkg}"]
    for name in spec.split(","):
        where = name.strip().rpartition(":")[0]
        if where.endswith(".py") and Path(where).is_file():
            parts.append(f"{Path(where).name} sha256:{hashlib.sha256(Path(where).read_bytes()).hexdigest()[:12]}")
    return "; ".join(parts)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is only reachable from this machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_exposure(host: str, token: str, allow_unauthenticated: bool) -> None:
    """A server that other hosts can reach needs a token, unless serving without one is asked for on purpose."""
    if not (token or allow_unauthenticated or is_loopback(host)):
        raise SageGRPOError(f"--host {host} lets other hosts reach the reward server, but {TOKEN_ENV} is not set: "
                            f"set it (the trainer sends the same value), or listen on 127.0.0.1, or pass "
                            "--allow_unauthenticated to serve without a token on purpose")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    token = os.environ.get(TOKEN_ENV, "")
    check_exposure(args.host, token, args.allow_unauthenticated)
    for name, value in (("port", args.port), ("max_batch", args.max_batch), ("max_request_mb", args.max_request_mb)):
        if value < 1 or (name == "port" and value > 65535):
            raise SageGRPOError(f"--{name} out of range: {value}")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise SageGRPOError("serving a reward needs FastAPI and uvicorn: pip install 'sage-grpo[serve]'") from None
    import torch

    from sage_grpo.rewards import build_reward
    from sage_grpo.rewards.server import make_app

    if any(n.strip().lower() == "remote" for n in args.reward_model.split(",")):
        raise SageGRPOError("--reward_model remote cannot be served (it is the client)")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        reward = build_reward(
            reward_model=args.reward_model, reward_weights="", reward_model_path=args.model_path,
            reward_base_model_path=args.base_model_path, reward_checkpoint_mode=args.checkpoint_mode,
            pretrained_model_root=args.pretrained_model_root, device=args.device, dtype=args.dtype,
            max_pixels=args.max_pixels, min_pixels=args.min_pixels, sample_fps=args.sample_fps,
            video_fps=args.video_fps, batch_size=args.batch_size,
            reward_checkpoint_step=None if args.checkpoint_step < 0 else args.checkpoint_step,
            clip_model_path=args.clip_model_path, pickscore_model_path=args.pickscore_model_path,
            pickscore_processor_path=args.pickscore_processor_path,
        )
    except SageGRPOError as e:
        raise SageGRPOError(own_flags(str(e))) from None
    ver = reward_version(args.reward_model, reward)
    app = make_app(reward, args.reward_model, ver, settings={k: getattr(args, k) for k in SETTINGS}, token=token,
                   max_batch=args.max_batch, batch_wait_s=args.batch_wait_ms / 1000, device=args.device,
                   max_body_bytes=args.max_request_mb << 20)
    print(f"serving {args.reward_model} ({', '.join(reward.components)}; version {ver}) on "
          f"http://{args.host}:{args.port}{' with a bearer token' if token else ''}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    run_cli(main)
