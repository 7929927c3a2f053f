"""mp4 writing and reading with imageio and its bundled ffmpeg (no system ffmpeg, no torchvision)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["frames_to_uint8", "write_video", "read_video"]


def frames_to_uint8(frames: Tensor) -> np.ndarray:
    """[F, 3, H, W] float in [0, 1] -> [F, H, W, 3] uint8 (rounded)."""
    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"expected frames [F, 3, H, W], got {tuple(frames.shape)}")
    x = (frames.detach().float().clamp(0, 1) * 255.0).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def write_video(path: str | Path, frames: Tensor, fps: int = 24, quality: int = 8) -> Path:
    """Write frames [F, 3, H, W] in [0, 1] as an H.264 mp4 (yuv420p, playable everywhere)."""
    import imageio.v2 as imageio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = frames_to_uint8(frames)
    # macro_block_size=1 keeps odd sizes (tiny videos) unresized; yuv420p still needs even sizes, ffmpeg pads them.
    with imageio.get_writer(path, fps=fps, codec="libx264", quality=quality, macro_block_size=1,
                            ffmpeg_params=["-pix_fmt", "yuv420p"], ffmpeg_log_level="error") as w:
        for frame in data:
            w.append_data(frame)
    return path


def read_video(path: str | Path) -> tuple[Tensor, float]:
    """mp4 -> (frames [F, 3, H, W] float in [0, 1], fps)."""
    import imageio.v2 as imageio

    reader = imageio.get_reader(path, format="ffmpeg")
    try:
        fps = float(reader.get_meta_data().get("fps", 0.0))
        data = np.stack([f for f in reader])
    finally:
        reader.close()
    return torch.from_numpy(data).permute(0, 3, 1, 2).float() / 255.0, fps
