"""mp4 reading/writing for scoring tables and the round-trip benchmark (imageio + its bundled ffmpeg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sage_grpo.errors import SageGRPOError


def write_mp4(
    path: str | Path, video: torch.Tensor, fps: float = 24.0, quality: float = 8.0, lossless: bool = False
) -> None:
    """Write one video float [F, 3, H, W] in [0, 1] as H.264 mp4.

    Default: yuv420p at imageio ``quality`` (what generation scripts write; even sides needed). ``lossless``:
    RGB H.264 with crf 0, which decodes to exactly the uint8-rounded frames (used to isolate codec error).
    """
    import imageio.v2 as imageio

    u8 = (video.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    if lossless:
        opts = dict(codec="libx264rgb", quality=None, pixelformat="rgb24", output_params=["-crf", "0"])
    else:
        opts = dict(codec="libx264", quality=quality)
    with imageio.get_writer(str(path), format="FFMPEG", fps=fps, macro_block_size=1, **opts) as w:
        for frame in u8:  # [H, W, 3] uint8
            w.append_data(frame)


def read_mp4(path: str | Path) -> tuple[torch.Tensor, float]:
    """Decode an mp4 -> (float [F, 3, H, W] in [0, 1], fps). Unreadable files become a SageGRPOError."""
    import imageio.v2 as imageio

    try:
        with imageio.get_reader(str(path), format="FFMPEG") as r:
            fps = float(r.get_meta_data().get("fps", 24.0))
            frames = [np.asarray(f) for f in r]
    except Exception as err:  # noqa: BLE001 - ffmpeg errors come in many types
        raise SageGRPOError(f"cannot decode video {path}: {type(err).__name__}: {str(err)[:200]}") from None
    if not frames:
        raise SageGRPOError(f"video {path} has no frames")
    arr = np.stack(frames)[..., :3]  # [F, H, W, 3] uint8
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255.0, fps
