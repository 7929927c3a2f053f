"""Torch-only Qwen2-VL video preprocessing (no torchvision, no PIL), running on the frames' device.

Reproduces what VideoAlign's inference does to an mp4 (``qwen_vl_utils.fetch_video`` + ``Qwen2VLProcessor``):
frame sampling at ``sample_fps`` from a ``video_fps`` video, smart-resize to multiples of 28 within
[min_pixels, max_pixels], antialiased bicubic resize of uint8-valued frames, rescale by 1/255, CLIP mean/std
normalisation and the Qwen2-VL patchify permutation (temporal patch 2, spatial merge 2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sage_grpo.config import REWARD_MAX_PIXELS, REWARD_MIN_PIXELS, REWARD_SAMPLE_FPS, VIDEO_FPS

# Qwen2-VL (= OpenAI CLIP) normalisation statistics, RGB
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH = 2
IMAGE_FACTOR = PATCH_SIZE * MERGE_SIZE  # 28: resized sides are multiples of this
FRAME_FACTOR = 2  # the number of sampled frames is a multiple of this (temporal patch)
FPS_MIN_FRAMES = 4  # qwen_vl_utils' lower bound on sampled frames
FPS_MAX_FRAMES = 768
MAX_RATIO = 200


def _round_by(x: float, f: int) -> int:
    """Closest multiple of ``f`` (Python round: half to even, as qwen_vl_utils)."""
    return round(x / f) * f


def _ceil_by(x: float, f: int) -> int:
    """Smallest multiple of ``f`` >= x."""
    return math.ceil(x / f) * f


def _floor_by(x: float, f: int) -> int:
    """Largest multiple of ``f`` <= x."""
    return math.floor(x / f) * f


def smart_resize(
    height: int, width: int, factor: int = IMAGE_FACTOR, min_pixels: int = REWARD_MIN_PIXELS,
    max_pixels: int = REWARD_MAX_PIXELS,
) -> tuple[int, int]:
    """Target (h, w): multiples of ``factor``, aspect ratio kept as well as possible, area in [min, max] pixels.

    E.g. 352x624 with max 200704 -> 336x588 (the rollout size of the paper).
    """
    if min(height, width) <= 0:
        raise ValueError(f"frame size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio of {height}x{width} exceeds {MAX_RATIO}")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels {min_pixels} > max_pixels {max_pixels}")
    h_bar = max(factor, _round_by(height, factor))
    w_bar = max(factor, _round_by(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, _floor_by(height / beta, factor))
        w_bar = max(factor, _floor_by(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil_by(height * beta, factor)
        w_bar = _ceil_by(width * beta, factor)
    return h_bar, w_bar


def sample_frame_indices(
    num_frames: int, video_fps: float = VIDEO_FPS, sample_fps: float = REWARD_SAMPLE_FPS
) -> torch.Tensor:
    """Indices of the frames VideoAlign looks at: ``sample_fps`` frames per second of a ``video_fps`` video.

    Same arithmetic as the ``smart_nframes`` of the ``vision_process.py`` that VideoAlign ships (the classic
    qwen_vl_utils rule: clamp to [min, max] frames, then round to the nearest even count) + ``torch.linspace(...)
    .round()``: 81 frames at 24 fps -> 6 frames, indices 0, 16, 32, 48, 64, 80; 85 frames -> 7.08 -> 8 frames.
    Short videos get at least 4 frames (or all, rounded down to even). Returns int64 [n].
    """
    if num_frames < FRAME_FACTOR:
        raise ValueError(f"VideoAlign needs at least {FRAME_FACTOR} frames, got {num_frames}")
    min_frames = _ceil_by(FPS_MIN_FRAMES, FRAME_FACTOR)
    max_frames = _floor_by(min(FPS_MAX_FRAMES, num_frames), FRAME_FACTOR)
    n = num_frames / video_fps * sample_fps
    n = _round_by(min(max(n, min_frames), max_frames), FRAME_FACTOR)  # <= max_frames, itself even and <= num_frames
    return torch.linspace(0, num_frames - 1, n).round().long()


def resize_frames(frames: torch.Tensor, size: tuple[int, int], quantize: bool = True) -> torch.Tensor:
    """Antialiased bicubic resize of frames in [0, 1]: float [N, C, H, W] -> float [N, C, h, w] in [0, 255].

    With ``quantize`` the input is rounded to uint8 levels first and the output rounded and clamped like
    torchvision does for uint8 tensors, so in-memory frames follow the same arithmetic as decoded mp4 frames.
    """
    x = frames.float() * 255.0  # [N, C, H, W]
    if quantize:
        x = x.round().clamp(0, 255)
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
    if quantize:
        x = x.round()
    return x.clamp(0, 255)


def normalize(frames255: torch.Tensor) -> torch.Tensor:
    """Rescale [0, 255] -> [0, 1] and apply CLIP mean/std per channel: [N, 3, h, w] -> [N, 3, h, w]."""
    mean = torch.tensor(CLIP_MEAN, dtype=frames255.dtype, device=frames255.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, dtype=frames255.dtype, device=frames255.device).view(1, 3, 1, 1)
    return (frames255 / 255.0 - mean) / std


def patchify(frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Qwen2-VL patch layout of one video: [T, C, H, W] -> ([t*h*w, C*2*14*14], (t, h, w)).

    An odd frame count is padded by repeating the last frame (as the reference processor does). Rows are ordered
    so that each consecutive group of merge^2 = 4 rows forms one 2x2 block the vision merger fuses into one token.
    """
    if frames.shape[0] % TEMPORAL_PATCH:
        pad = frames[-1:].expand(TEMPORAL_PATCH - frames.shape[0] % TEMPORAL_PATCH, -1, -1, -1)
        frames = torch.cat([frames, pad], dim=0)
    T, C, H, W = frames.shape
    if H % IMAGE_FACTOR or W % IMAGE_FACTOR:
        raise ValueError(f"frame size {H}x{W} is not a multiple of {IMAGE_FACTOR}")
    gt, gh, gw = T // TEMPORAL_PATCH, H // PATCH_SIZE, W // PATCH_SIZE
    x = frames.reshape(
        gt, TEMPORAL_PATCH, C, gh // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE, gw // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE
    )
    # -> [gt, gh/2, gw/2, 2, 2, C, tp, 14, 14]: merge blocks outermost, then channel-major patch pixels
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, C * TEMPORAL_PATCH * PATCH_SIZE * PATCH_SIZE), (gt, gh, gw)


def preprocess_videos(
    videos: torch.Tensor,
    video_fps: float = VIDEO_FPS,
    sample_fps: float = REWARD_SAMPLE_FPS,
    min_pixels: int = REWARD_MIN_PIXELS,
    max_pixels: int = REWARD_MAX_PIXELS,
    quantize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Videos float [B, F, 3, H, W] in [0, 1] -> (pixel_values [B*t*h*w, 1176], video_grid_thw int64 [B, 3]).

    All videos of a batch share F, H, W (rollouts do), so every video gets the same grid.
    """
    if videos.ndim != 5 or videos.shape[2] != 3:
        raise ValueError(f"expected videos [B, F, 3, H, W], got {tuple(videos.shape)}")
    x = resize_read(read_frames(videos, video_fps, sample_fps), min_pixels, max_pixels, quantize)
    return pixels_from_read(x)


def read_frames(videos: torch.Tensor, video_fps: float = VIDEO_FPS,
                sample_fps: float = REWARD_SAMPLE_FPS) -> torch.Tensor:
    """The frames VideoAlign looks at: [B, F, 3, H, W] -> [B, n, 3, H, W] (`sample_frame_indices`)."""
    idx = sample_frame_indices(videos.shape[1], video_fps, sample_fps).to(videos.device)
    return videos.index_select(1, idx)


def resize_read(frames: torch.Tensor, min_pixels: int = REWARD_MIN_PIXELS, max_pixels: int = REWARD_MAX_PIXELS,
                quantize: bool = True) -> torch.Tensor:
    """Sampled frames [B, n, 3, H, W] in [0, 1] -> smart-resized [B, n, 3, h, w] in [0, 255] (whole numbers with
    ``quantize``): what VideoAlign reads, and what a reward server of it receives."""
    B, n, _, H, W = frames.shape
    size = smart_resize(H, W, min_pixels=min_pixels, max_pixels=max_pixels)
    return resize_frames(frames.reshape(B * n, 3, H, W), size, quantize).reshape(B, n, 3, *size)


def pixels_from_read(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`resize_read`'s [B, n, 3, h, w] in [0, 255] -> (pixel_values [B*t*h*w, 1176], video_grid_thw int64 [B, 3])."""
    B, n, _, h, w = x.shape
    x = normalize(x.reshape(B * n, 3, h, w)).reshape(B, n, 3, h, w)
    patches, grids = [], []
    for b in range(B):
        p, g = patchify(x[b])
        patches.append(p)
        grids.append(g)
    grid = torch.tensor(grids, dtype=torch.long, device=x.device)
    return torch.cat(patches, dim=0), grid
