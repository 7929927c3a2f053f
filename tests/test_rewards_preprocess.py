"""Torch-only Qwen2-VL video preprocessing against hand values, explicit loops and transformers' PIL processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sage_grpo.rewards.video_preprocess import (
    CLIP_MEAN,
    CLIP_STD,
    normalize,
    patchify,
    preprocess_videos,
    resize_frames,
    sample_frame_indices,
    smart_resize,
)


def test_frame_sampling_matches_authors():
    """81 frames at 24 fps sampled at 2 fps -> 0,16,...,80; short videos get >= 4 (even) frames."""
    assert sample_frame_indices(81).tolist() == [0, 16, 32, 48, 64, 80]
    assert sample_frame_indices(121).tolist() == torch.linspace(0, 120, 10).round().long().tolist()  # 10.08 -> 10
    assert sample_frame_indices(9).tolist() == [0, 3, 5, 8]  # linspace(0, 8, 4) = 0, 2.67, 5.33, 8
    assert sample_frame_indices(5).tolist() == [0, 1, 3, 4]
    assert sample_frame_indices(3).tolist() == [0, 2]
    assert len(sample_frame_indices(81, sample_fps=24.0)) == 80  # 81 floored to an even count
    # VideoAlign's vision_process.smart_nframes rounds to the nearest even count (round half to even):
    # frames -> frames / 24 * 2 -> count
    for frames, count in [(61, 6), (65, 6), (69, 6), (85, 8), (89, 8), (93, 8), (109, 10), (113, 10), (117, 10),
                          (133, 12), (57, 4), (73, 6), (97, 8)]:
        assert len(sample_frame_indices(frames)) == count, frames
    with pytest.raises(ValueError, match="at least 2 frames"):
        sample_frame_indices(1)


def test_smart_resize_hand_values():
    """The paper's 352x624 -> 336x588; small frames grow to min_pixels; results are multiples of 28."""
    assert smart_resize(352, 624, max_pixels=200704) == (336, 588)
    assert smart_resize(480, 864, max_pixels=200704) == (308, 588)
    assert smart_resize(56, 84, min_pixels=3136, max_pixels=200704) == (56, 84)
    h, w = smart_resize(32, 32, min_pixels=100352, max_pixels=200704)
    assert (h, w) == (336, 336) and h * w >= 100352
    for hw in ((33, 47), (100, 999), (720, 1280)):
        h, w = smart_resize(*hw, min_pixels=3136, max_pixels=200704)
        assert h % 28 == 0 and w % 28 == 0 and 3136 <= h * w <= 200704
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 5000)


def _patchify_loop(frames: torch.Tensor) -> torch.Tensor:
    """Independent reference: walk 2x2 merge blocks in raster order, each patch as [C, tp, 14, 14] flattened."""
    T, C, H, W = frames.shape
    rows = []
    for t in range(T // 2):
        for bi in range(H // 28):
            for bj in range(W // 28):
                for mi in range(2):
                    for mj in range(2):
                        y, x = (2 * bi + mi) * 14, (2 * bj + mj) * 14
                        p = frames[2 * t : 2 * t + 2, :, y : y + 14, x : x + 14]  # [tp, C, 14, 14]
                        rows.append(p.permute(1, 0, 2, 3).reshape(-1))
    return torch.stack(rows)


def test_patchify_against_loop_and_odd_frames():
    """Patch layout equals the explicit loop; an odd frame count repeats the last frame."""
    x = torch.randn(4, 3, 56, 84, generator=torch.Generator().manual_seed(0))
    pv, grid = patchify(x)
    assert grid == (2, 4, 6) and pv.shape == (2 * 4 * 6, 3 * 2 * 14 * 14)
    assert torch.equal(pv, _patchify_loop(x))
    pv3, grid3 = patchify(x[:3])
    assert grid3 == (2, 4, 6) and torch.equal(pv3, _patchify_loop(torch.cat([x[:3], x[2:3]])))


def test_matches_transformers_qwen2vl_processor_on_presized_frames():
    """Normalise + patchify equals transformers' (PIL) Qwen2VLImageProcessor on a frame already of valid size.

    (Its video processor needs torchvision, absent here; the image path duplicates the frame in time, which is the
    same as a 2-frame video of identical frames.)
    """
    proc_cls = pytest.importorskip("transformers").Qwen2VLImageProcessorPil
    img = (np.random.RandomState(0).rand(56, 84, 3) * 255).astype(np.uint8)
    ref = proc_cls(min_pixels=3136, max_pixels=200704)(images=[img], return_tensors="pt")
    x = torch.from_numpy(img).permute(2, 0, 1).float()[None]  # [1, 3, 56, 84] in 0..255
    pv, grid = patchify(normalize(x).expand(2, -1, -1, -1))
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    torch.testing.assert_close(pv, ref["pixel_values"], rtol=0, atol=1e-5)


def test_normalize_and_resize_semantics():
    """CLIP mean/std per channel; constant frames stay constant through the bicubic resize; uint8 rounding."""
    x = torch.full((1, 3, 2, 2), 255.0)
    got = normalize(x)[0, :, 0, 0]
    torch.testing.assert_close(got, (1 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD))
    const = torch.full((2, 3, 30, 40), 0.25)
    out = resize_frames(const, (56, 84))
    assert out.shape == (2, 3, 56, 84) and torch.all(out == round(0.25 * 255))
    raw = resize_frames(const, (56, 84), quantize=False)
    torch.testing.assert_close(raw, torch.full_like(raw, 0.25 * 255))
    ramp = torch.linspace(0, 1, 30 * 40).view(1, 1, 30, 40).expand(1, 3, -1, -1)
    q = resize_frames(ramp, (28, 28))
    assert torch.equal(q, q.round()) and q.min() >= 0 and q.max() <= 255


def test_preprocess_videos_shapes_and_device():
    """Videos -> concatenated patches + per-video grids; 81x352x624 -> 6 frames at 336x588 (the paper's case)."""
    v = torch.rand(2, 9, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    pv, grid = preprocess_videos(v, min_pixels=28 * 28 * 4)
    assert grid.tolist() == [[2, 4, 6]] * 2 and pv.shape == (2 * 2 * 4 * 6, 1176)  # 32x48 -> 56x84
    # second video's patches follow the first's, and each equals its own single-video preprocessing
    pv1, _ = preprocess_videos(v[1:], min_pixels=28 * 28 * 4)
    assert torch.equal(pv[48:], pv1)
    big = torch.rand(1, 81, 3, 352, 624, generator=torch.Generator().manual_seed(1))
    pv, grid = preprocess_videos(big)
    assert grid.tolist() == [[3, 24, 42]] and pv.shape == (3 * 24 * 42, 1176)


def _pil_bicubic(frames255: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Independent antialiased resize: PIL's bicubic on float ('F') images, channel by channel, then uint8 rounding.
    frames255: [N, C, H, W] float in 0..255 -> [N, C, h, w]."""
    from PIL import Image

    out = [[np.asarray(Image.fromarray(ch.astype(np.float32), mode="F").resize((size[1], size[0]), Image.BICUBIC))
            for ch in frame] for frame in frames255]
    return np.clip(np.round(np.asarray(out, dtype=np.float64)), 0, 255)


def test_real_downscale_is_antialiased_like_an_independent_resize():
    """Frames that need resizing (150x210 noise, the worst case for aliasing) agree with PIL's antialiased bicubic to
    one uint8 level; a plain (aliasing) bicubic is off by tens of levels on average."""
    frames = torch.from_numpy(np.random.RandomState(0).rand(2, 3, 150, 210)).float()  # [N, 3, H, W] in [0, 1]
    q = (frames.double() * 255).round().clamp(0, 255).numpy()
    for size in ((56, 84), (112, 140)):
        ours = resize_frames(frames, size).double().numpy()
        ref = _pil_bicubic(q, size)
        assert np.abs(ours - ref).max() <= 1.0 and np.abs(ours - ref).mean() < 0.05, size
    # through the whole preprocessing: 4 frames sampled, resized to smart_resize's size, normalised, patchified
    video = frames[:1].unsqueeze(1).expand(1, 4, 3, 150, 210).contiguous()  # [1, 4, 3, 150, 210], still video
    pv, grid = preprocess_videos(video, min_pixels=3136, max_pixels=56 * 84)
    size = smart_resize(150, 210, min_pixels=3136, max_pixels=56 * 84)
    ref = torch.from_numpy(_pil_bicubic(q[:1], size)).float().expand(4, -1, -1, -1)
    expected, _ = patchify(normalize(ref))
    assert grid.tolist() == [[2, size[0] // 14, size[1] // 14]]
    assert (pv - expected).abs().max().item() <= 1.0 / 255 / min(CLIP_STD) + 1e-5  # one uint8 level
