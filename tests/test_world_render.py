"""World rendering and sampling: geometry, determinism, the train / held-out split."""

from __future__ import annotations

import math
import random

import pytest
import torch
from world_fixtures import one_thread  # noqa: F401 - autouse fixture

from sage_grpo.errors import SageGRPOError
from sage_grpo.world.captions import COLORS, SHAPES, parse_caption
from sage_grpo.world.render import layout, render, render_caption, shape_coverage
from sage_grpo.world.sampler import (
    HELDOUT_PAIRS,
    is_heldout,
    iter_clips,
    sample_attributes,
    sample_clip,
    single_object_attributes,
    world_captions,
)


def test_clip_format_and_pixels():
    """[F, 3, H, W] float32 in [0, 1]; the corner is the background colour and the object's centre its colour."""
    caption = "a large red square moves down on a blue background"
    scene = layout(parse_caption(caption), random.Random(3))
    video = render(scene)
    assert video.shape == (9, 3, 32, 32) and video.dtype == torch.float32
    assert 0.0 <= float(video.min()) and float(video.max()) <= 1.0
    bg, red = torch.tensor(COLORS["blue"]), torch.tensor(COLORS["red"])
    assert torch.allclose(video[:, :, 0, 0], bg.expand(9, 3))
    centres = scene.paths[0].centres(9)  # [F, 2]
    for f in range(9):
        x, y = (int(v) for v in centres[f])
        assert torch.allclose(video[f, :, y, x], red)


@pytest.mark.parametrize("size, frames", [(32, 9), (64, 17)])
def test_motion_matches_the_caption_and_stays_in_frame(size, frames):
    """Centres move the captioned way by 25-45% of the frame; bounces reverse at a wall; objects never leave."""
    for seed in range(20):
        clip = sample_clip(seed, size=size, num_frames=frames)
        for path in clip.scene.paths:
            c = path.centres(frames)  # [F, 2]
            assert float((c - path.radius).min()) >= 0 and float((c + path.radius).max()) <= size
            d = c[-1] - c[0]
            motion = clip.attributes.motion
            want = {"right": (0, 1), "left": (0, -1), "down": (1, 1), "up": (1, -1)}.get(motion)
            if want is not None:
                axis, sign = want
                assert 0.25 * size - 1e-6 <= sign * float(d[axis]) <= 0.45 * size + 1e-6
                assert float(d[1 - axis]) == 0.0
            else:
                excursion = (c.max(0).values - c.min(0).values).max()
                assert float(d.abs().max()) < 0.5 * float(excursion)
                # it touches a wall (0.5 px margin) between two frames: at a frame it is at most half a step away
                at_wall = torch.minimum(c - path.radius, size - c - path.radius).min()
                speed = max(abs(v) for v in path.velocity)
                assert float(at_wall) <= 0.5 + speed / 2 + 1e-6


def test_two_objects_never_overlap():
    """Two-object clips keep their objects in separate lanes: no pixel is covered by both."""
    for seed in range(40):
        clip = sample_clip(seed, two_object_prob=1.0)
        covs = []
        for p in clip.scene.paths:
            r = torch.full((9, 2), p.radius, dtype=torch.float64)
            covs.append(shape_coverage(p.attrs.shape, p.centres(9), r, 32, 32))
        assert float((covs[0] * covs[1]).max()) == 0.0


def test_shape_areas_match_geometry():
    """Anti-aliased coverage integrates to the analytic area of each shape (circle pi r^2, square 4r^2, triangle
    2r^2)."""
    centres = torch.tensor([[15.3, 16.7]], dtype=torch.float64)
    radii = torch.tensor([[6.4, 6.4]], dtype=torch.float64)
    exact = {"circle": math.pi * 6.4**2, "square": 4 * 6.4**2, "triangle": 2 * 6.4**2}
    for shape in SHAPES:
        area = float(shape_coverage(shape, centres, radii, 32, 32).sum())
        assert abs(area - exact[shape]) / exact[shape] < 0.03, shape  # 4x4 samples per pixel


def test_sampling_is_deterministic_and_seeded():
    """Same (seed, index, split) = the same clip bit for bit; another seed differs; captions match attributes."""
    a, b = sample_clip(7, 3), sample_clip(7, 3)
    assert torch.equal(a.video, b.video) and a.caption == b.caption
    assert not torch.equal(a.video, sample_clip(8, 3).video)
    assert parse_caption(a.caption) == a.attributes
    stream = iter_clips(7, start=2)
    assert next(stream).caption == sample_clip(7, 2).caption and next(stream).caption == a.caption
    assert world_captions(5, seed=7) == [sample_clip(7, i).caption for i in range(5)]
    assert torch.equal(render_caption(a.caption, seed=1), render_caption(a.caption, seed=1))


def test_split_holds_out_colour_shape_pairs_only():
    """Train never shows a held-out pair, held-out always does, and training still sees every colour and shape."""
    rng = random.Random(0)
    train = [sample_attributes(rng, "train") for _ in range(300)]
    held = [sample_attributes(rng, "heldout") for _ in range(50)]
    assert not any(is_heldout(a) for a in train) and all(is_heldout(a) for a in held)
    seen_pairs = {(o.color, o.shape) for a in train for o in a.objects}
    assert not seen_pairs & HELDOUT_PAIRS
    assert {c for c, _ in seen_pairs} == set(COLORS) and {s for _, s in seen_pairs} == set(SHAPES)
    grid_train, grid_held = single_object_attributes("train"), single_object_attributes("heldout")
    assert not set(grid_train) & set(grid_held)
    assert len(grid_train) + len(grid_held) == 2 * 3 * 7 * 5 * 6
    assert len(grid_held) == 2 * 7 * 5 * 6  # one shape per colour, both sizes, every motion and background


def test_bad_geometry_and_split_fail_clearly():
    """Frame counts that are not 4k+1, odd sizes and unknown splits are one-line user errors."""
    with pytest.raises(SageGRPOError, match="4k\\+1 frames"):
        sample_clip(0, num_frames=8)
    with pytest.raises(SageGRPOError, match="multiple of 16"):
        sample_clip(0, size=40)
    with pytest.raises(SageGRPOError, match="unknown world split 'test'.*train, heldout"):
        sample_clip(0, split="test")


def test_show_world_writes_a_grid(tmp_path):
    """scripts/show_world.py writes a PNG of n rows x frames columns; a bad split is one error line."""
    import importlib.util
    from pathlib import Path

    import numpy as np
    from PIL import Image

    path = Path(__file__).resolve().parents[1] / "scripts/show_world.py"
    spec = importlib.util.spec_from_file_location("show_world", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--out", str(tmp_path / "grid.png"), "--n", "2"])
    img = np.asarray(Image.open(out).convert("RGB"))
    assert img.shape[0] > 100 and img.shape[1] > 500
    red = (img[..., 0] > 200) & (img[..., 1] < 60) & (img[..., 2] < 60)
    assert red.any()  # seed 0's first clip is a red square on black
    with pytest.raises(SageGRPOError, match="unknown world split"):
        mod.main(["--out", str(tmp_path / "x.png"), "--split", "nope"])
