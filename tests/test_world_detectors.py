"""World detectors: exact on rendered clips over many seeds, >= 95% right on blurred noisy ones, sane on junk."""

from __future__ import annotations

import pytest
import torch
from world_fixtures import degrade, one_thread  # noqa: F401 - autouse fixture

from sage_grpo.world.captions import COLORS, Attributes
from sage_grpo.world.detectors import (
    classify_motion,
    connected_components,
    detect,
    detected_attributes,
    nearest_color,
)
from sage_grpo.world.render import render_caption
from sage_grpo.world.sampler import sample_clip


def _reads_correctly(video: torch.Tensor, attrs: Attributes) -> bool:
    """Every attribute of ``attrs`` read back: background, and per object colour, shape, size and motion."""
    det = detect(video)
    if det.background != attrs.background or len(det.objects) != len(attrs.objects):
        return False
    got = {(o.color, o.shape, o.size, o.motion) for o in det.objects}
    want = {(o.color, o.shape, o.size, attrs.motion) for o in attrs.objects}
    return got == want


def _accuracy(n: int, seed: int, noisy: bool, **clip_kwargs) -> float:
    g = torch.Generator().manual_seed(seed)
    ok = 0
    for i in range(n):
        clip = sample_clip(seed, i, two_object_prob=0.3, **clip_kwargs)
        video = degrade(clip.video, g) if noisy else clip.video
        ok += _reads_correctly(video, clip.attributes)
    return ok / n


def test_exact_on_rendered_clips():
    """Every attribute of 40 rendered clips (one and two objects, train and held-out) is read back."""
    assert _accuracy(32, seed=1, noisy=False) == 1.0
    assert _accuracy(8, seed=2, noisy=False, split="heldout") == 1.0


def test_exact_on_larger_longer_clips():
    """The detectors are scale-free: 64 px, 17-frame clips are read exactly too."""
    assert _accuracy(6, seed=3, noisy=False, size=64, num_frames=17) == 1.0


def test_robust_to_blur_and_noise():
    """Blur (binomial 3x3) + Gaussian noise std 0.05: at least 95% of clips read back entirely."""
    assert _accuracy(40, seed=4, noisy=True) >= 0.95


@pytest.mark.slow
def test_exact_and_robust_over_many_seeds():
    """The same two claims over 400 clips each."""
    assert _accuracy(400, seed=10, noisy=False) == 1.0
    assert _accuracy(400, seed=11, noisy=True) >= 0.95


def test_measured_values_of_a_known_clip():
    """Colour and area of a rendered clip equal the geometry's (a small square is (8 px)^2 of a 32 px frame)."""
    video = render_caption("a small green square moves left on a black background", seed=5)
    det = detect(video)
    assert det.background == "black" and torch.allclose(torch.tensor(det.background_rgb), torch.tensor(COLORS["black"]))
    (obj,) = det.objects
    assert torch.allclose(torch.tensor(obj.rgb), torch.tensor(COLORS["green"]))
    assert torch.allclose(obj.area, torch.full((9,), 64 / 1024), atol=1e-5)
    assert obj.shape_iou > 0.99 and obj.present == 1.0 and abs(obj.extent - 0.25) < 0.01


def test_blank_and_noise_clips_have_no_objects():
    """A plain frame has a background and no object; uniform noise gives no confident object either."""
    blank = torch.tensor(COLORS["yellow"]).view(1, 3, 1, 1).expand(9, 3, 32, 32).clone()
    det = detect(blank)
    assert det.background == "yellow" and det.objects == () and not det.object_mask.any()
    assert detected_attributes(det) is None
    noise = torch.rand(9, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert all(o.shape_iou < 0.8 for o in detect(noise).objects)


def test_nearest_color_and_components():
    """Palette colours are their own nearest name; 8-connected blobs get one label, separate blobs two."""
    names = list(COLORS)
    idx, dist = nearest_color(torch.tensor(list(COLORS.values())))
    assert idx.tolist() == list(range(len(names))) and float(dist.max()) == 0.0
    m = torch.zeros(1, 6, 6, dtype=torch.bool)
    m[0, 0, 0] = m[0, 1, 1] = True  # diagonal neighbours: one component
    m[0, 4:, 4:] = True  # a separate 2x2 block
    lab = connected_components(m)[0]
    assert lab[0, 0] == lab[1, 1] != 0 and lab[4, 4] == lab[5, 5] != lab[0, 0]
    assert int((lab > 0).sum()) == 6 and len(lab.unique()) == 3


def test_classify_motion_on_tracks():
    """Lines by the sign of the net displacement, bounces by a return, still under a tenth of the frame."""
    t = torch.arange(9, dtype=torch.float32)
    zeros = torch.zeros(9)
    assert classify_motion(torch.stack([10 + t, zeros + 5], 1), 32) == "right"
    assert classify_motion(torch.stack([20 - t, zeros + 5], 1), 32) == "left"
    assert classify_motion(torch.stack([zeros + 5, 10 + t], 1), 32) == "down"
    assert classify_motion(torch.stack([zeros + 5, 20 - t], 1), 32) == "up"
    assert classify_motion(torch.stack([10 + 4 - (4 - t).abs(), zeros], 1), 32) == "bounces"
    assert classify_motion(torch.stack([10 + 0.3 * t, zeros], 1), 32) == "still"  # 2.4 px < 3.2 px
    gappy = torch.stack([10 + t, zeros], 1)
    gappy[3:6] = float("nan")  # missing frames are skipped
    assert classify_motion(gappy, 32) == "right"
    assert classify_motion(torch.full((9, 2), float("nan")), 32) == "still"


def test_bad_input_is_rejected():
    """A batch or a non-float clip is a ValueError naming the expected layout."""
    with pytest.raises(ValueError, match=r"\[F, 3, H, W\]"):
        detect(torch.zeros(2, 9, 3, 32, 32))
    with pytest.raises(ValueError, match=r"\[F, 3, H, W\]"):
        detect(torch.zeros(9, 3, 32, 32, dtype=torch.uint8))
