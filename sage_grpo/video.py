"""mp4 writing and reading (imageio with its bundled ffmpeg from imageio-ffmpeg; no system ffmpeg, no torchvision),
and the `<name>.txt` prompt file kept beside a generated video.

The one place the project touches mp4 files: generate.py, training validation, scripts/score_videos.py and
scripts/bench_reward.py all come through here. The ffmpeg backend is always named explicitly, so a missing
imageio-ffmpeg is one clear error (`check_mp4_support`) instead of imageio falling through to another plugin.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from sage_grpo.errors import SageGRPOError

__all__ = [
    "check_mp4_support",
    "frames_to_uint8",
    "write_video",
    "read_video",
    "write_prompt_file",
    "read_prompt_file",
    "write_text_atomic",
]

_FFMPEG_HINT = "pip install imageio-ffmpeg (a dependency of this package: pip install -e .)"


def check_mp4_support() -> str:
    """Fail with one message when mp4 support (imageio + imageio-ffmpeg's ffmpeg binary) is missing; returns the
    ffmpeg executable. Call it before spending time on sampling."""
    try:
        import imageio.v2  # noqa: F401
        import imageio_ffmpeg
    except ImportError as err:
        raise SageGRPOError(f"mp4 files need ffmpeg support, which is missing ({err.name} is not installed): "
                            f"{_FFMPEG_HINT}") from None
    try:
        return imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as err:  # noqa: BLE001 - RuntimeError when no binary is found, OSError on broken installs
        raise SageGRPOError(f"mp4 files need ffmpeg support, which is missing (imageio-ffmpeg found no ffmpeg: "
                            f"{_first_line(err)}): {_FFMPEG_HINT}") from None


def _first_line(err: BaseException) -> str:
    """An exception as one line: ffmpeg errors carry its whole banner after the first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def frames_to_uint8(frames: Tensor) -> np.ndarray:
    """[F, 3, H, W] float in [0, 1] -> [F, H, W, 3] uint8 (rounded)."""
    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"expected frames [F, 3, H, W], got {tuple(frames.shape)}")
    x = (frames.detach().float().clamp(0, 1) * 255.0).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def write_video(path: str | Path, frames: Tensor, fps: float = 24, quality: float = 8, lossless: bool = False) -> Path:
    """Write frames [F, 3, H, W] in [0, 1] as an H.264 mp4; creates the parent folder; returns the path.

    Default: yuv420p at imageio `quality` (playable everywhere; what generation writes). `lossless`: RGB H.264 with
    crf 0, which decodes to exactly the uint8-rounded frames (used to isolate codec error).
    """
    check_mp4_support()
    import imageio.v2 as imageio

    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = frames_to_uint8(frames)
    if lossless:
        opts = dict(codec="libx264rgb", quality=None, pixelformat="rgb24", output_params=["-crf", "0"])
    else:
        opts = dict(codec="libx264", quality=quality, pixelformat="yuv420p")
    # written beside the target and renamed when complete: an interrupted write leaves no half-written mp4
    tmp = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        # macro_block_size=1 keeps odd sizes (tiny videos) unresized; yuv420p still needs even sizes, ffmpeg pads.
        with imageio.get_writer(tmp, format="FFMPEG", fps=fps, macro_block_size=1, ffmpeg_log_level="error",
                                **opts) as w:
            for frame in data:
                w.append_data(frame)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_video(path: str | Path) -> tuple[Tensor, float]:
    """mp4 -> (frames [F, 3, H, W] float in [0, 1], fps; 0.0 when the file does not say). An unreadable file is a
    SageGRPOError of one line (ffmpeg's banner is left out)."""
    check_mp4_support()
    import imageio.v2 as imageio

    try:
        with imageio.get_reader(str(path), format="FFMPEG") as r:
            fps = float(r.get_meta_data().get("fps", 0.0) or 0.0)
            frames = [np.asarray(f) for f in r]
    except Exception as err:  # noqa: BLE001 - ffmpeg errors come in many types
        raise SageGRPOError(f"cannot decode video {path}: {_first_line(err)}") from None
    if not frames:
        raise SageGRPOError(f"video {path} has no frames")
    arr = np.stack(frames)[..., :3]  # [F, H, W, 3] uint8
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255.0, fps


def write_prompt_file(video_path: str | Path, prompt: str) -> Path:
    """`<stem>.txt` beside the video holding the exact prompt (UTF-8, one trailing newline added)."""
    return write_text_atomic(Path(video_path).with_suffix(".txt"), prompt + "\n")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """`path` holds `text` (UTF-8) or is left as it was: written beside it, then renamed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_prompt_file(video_path: str | Path) -> str | None:
    """The prompt stored beside a video by `write_prompt_file` (exactly: only the one trailing newline is removed),
    or None when there is no `<stem>.txt` or it holds no text."""
    path = Path(video_path).with_suffix(".txt")
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SageGRPOError(f"cannot read the prompt file {path}: {err}") from None
    text = text[:-1] if text.endswith("\n") else text
    text = text[:-1] if text.endswith("\r") else text
    return text if text.strip() else None
