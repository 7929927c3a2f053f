"""The hacking check (sage_grpo/hacking.py) and the held-out metrics validation reports (sage_grpo/heldout.py)."""

from __future__ import annotations

import math

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.hacking import REWARD, Summary, hacking_warnings, shift
from sage_grpo.heldout import (
    DRIFT_FRAMES,
    DRIFT_HEIGHT,
    STATISTICS,
    WORLD_METRICS,
    HeldOut,
    drift_frames,
    parse_validation_metrics,
    video_statistics,
)

SENSES = {"VQ": 1, "saturation": 0, "loss": -1, "drift": None}


def _check(first, now, warned=(), rise=1.0, drop=1.0, senses=SENSES):
    return hacking_warnings(first, now, senses, warned, step=7, reward_rise=rise, metric_drop=drop)


def _first():
    return {REWARD: (1.0, 0.5), "VQ": (2.0, 1.0), "saturation": (0.3, 0.1), "loss": (1.0, 1.0), "drift": (0.0, 0.0)}


def test_fires_when_the_reward_rises_and_a_held_out_metric_falls():
    now = {**_first(), REWARD: (2.0, 0.5), "VQ": (0.5, 1.0)}  # reward +2 spreads, VQ -1.5
    (w,) = _check(_first(), now)
    assert (w.metric, w.step, w.metric_shift, w.reward_shift, w.first, w.now) == ("VQ", 7, -1.5, 2.0, 2.0, 0.5)
    assert "held-out VQ fell -1.50 spreads" in w.message() and "step 7" in w.message()


def test_silent_while_learning_or_when_the_reward_does_not_rise():
    assert _check(_first(), {**_first(), REWARD: (3.0, 0.5), "VQ": (2.5, 1.0)}) == []  # both rise: learning
    assert _check(_first(), {**_first(), REWARD: (1.2, 0.5), "VQ": (0.0, 1.0)}) == []  # reward +0.4 only
    assert _check(_first(), {**_first(), REWARD: (0.0, 0.5), "VQ": (0.0, 1.0)}) == []  # reward fell
    assert _check(_first(), {**_first(), REWARD: (math.nan, math.nan), "VQ": (0.0, 1.0)}) == []
    assert _check({}, {**_first(), REWARD: (3.0, 0.5), "VQ": (0.0, 1.0)}) == []  # no baseline yet


def test_warns_once_per_metric():
    now = {**_first(), REWARD: (3.0, 0.5), "VQ": (0.0, 1.0), "saturation": (0.1, 0.1)}
    assert [w.metric for w in _check(_first(), now)] == ["VQ", "saturation"]
    assert [w.metric for w in _check(_first(), now, warned={"VQ": 3})] == ["saturation"]
    assert _check(_first(), now, warned={"VQ": 3, "saturation": 3}) == []


def test_threshold_edges_are_strict():
    first = {REWARD: (0.0, 1.0), "VQ": (0.0, 1.0)}
    now = {REWARD: (1.0, 1.0), "VQ": (-1.0, 1.0)}  # both shifts exactly 1 spread
    assert shift(first[REWARD], now[REWARD]) == 1.0 and shift(first["VQ"], now["VQ"]) == -1.0
    assert _check(first, now) == []  # at the threshold: silent
    assert _check(first, now, rise=0.999) == []  # the metric is still at its threshold
    assert [w.metric for w in _check(first, now, rise=0.999, drop=0.999)] == ["VQ"]


def test_each_sense_warns_on_its_wrong_side():
    first = {REWARD: (0.0, 1.0), "VQ": (0.0, 1.0), "saturation": (0.5, 0.1), "loss": (0.0, 1.0), "drift": (0.0, 0.0)}
    up = {REWARD: (5.0, 1.0), "VQ": (2.0, 1.0), "saturation": (0.8, 0.1), "loss": (2.0, 1.0), "drift": (9.0, 1.0)}
    assert [w.metric for w in _check(first, up)] == ["saturation", "loss"]  # a statistic either way, never drift
    down = {**up, "VQ": (-2.0, 1.0), "saturation": (0.2, 0.1), "loss": (-2.0, 1.0)}
    assert [w.metric for w in _check(first, down)] == ["VQ", "saturation"]
    assert "saturation fell" in _check(first, down)[1].message()
    assert "saturation rose" in _check(first, up)[0].message()


def test_spread_is_pooled_and_floored():
    assert shift((1.0, 0.0), (2.0, 0.0)) == pytest.approx(1.0 / 0.02)  # one video: 1% of the magnitude
    assert shift((0.0, 0.0), (0.0, 0.0)) == 0.0
    assert shift(Summary(0.0, 3.0), [1.0, 4.0]) == pytest.approx(1 / math.sqrt(12.5))
    assert math.isnan(shift((math.nan, 1.0), (1.0, 1.0)))


def test_records_shaped_like_a_brightness_hack_on_the_tiny_model():
    """The summaries a tiny brightness run with KL off logged at steps 0 and 2 (validate_at_step0; train_state.json's
    val_first and metrics.jsonl): brighter, greyer, flatter and stiller. The default thresholds flag all three."""
    first = {REWARD: [0.48023, 0.00317], "saturation": [0.34730, 0.00528], "contrast": [0.12481, 0.00070],
             "motion": [0.17717, 0.00121], "drift": [0.0, 0.0]}
    now = {REWARD: [0.49710, 0.00620], "saturation": [0.32360, 0.00603], "contrast": [0.12240, 0.00172],
           "motion": [0.17210, 0.00126], "drift": [0.105, 0.01]}
    senses = {"saturation": 0, "contrast": 0, "motion": 0, "drift": None}
    warned = _check(first, now, senses=senses)
    assert [w.metric for w in warned] == ["saturation", "contrast", "motion"]
    assert all(w.reward_shift > 3 and w.metric_shift < -1 for w in warned)


# ------------------------------------------------------------------------------------------------ held-out metrics


def test_parse_validation_metrics():
    plain, world = ["a cat sleeps"], ["a small red circle moves right on a blue background"]
    assert parse_validation_metrics(["auto"], ["brightness"], plain).groups == {"components", "statistics", "drift"}
    assert parse_validation_metrics(["auto"], ["brightness"], world).groups == {"components", "statistics", "drift",
                                                                              "world"}
    spec = parse_validation_metrics(["statistics", "ClipScore"], ["videoalign_local"], plain)
    assert spec.groups == {"statistics"} and spec.rewards == ("clipscore",)
    assert parse_validation_metrics(["none"], ["brightness"], plain).groups == set()
    for items, trained, prompts, message in (
            (["sharpness"], ["brightness"], plain, "unknown 'sharpness'"),
            (["none", "drift"], ["brightness"], plain, "pass it alone"),
            (["brightness"], ["brightness", "color"], plain, "that reward is trained"),
            (["world"], ["brightness"], plain, "world captions"),
    ):
        with pytest.raises(SageGRPOError, match=message):
            parse_validation_metrics(items, trained, prompts)


def _reward(name, weights=None):
    from sage_grpo.rewards import build_reward

    return build_reward(name, reward_weights=weights)


def test_held_out_names_leave_out_what_the_reward_trains():
    spec = parse_validation_metrics(["auto"], ["brightness"], ["a cat"])
    assert HeldOut(spec, _reward("brightness")).senses == {"saturation": 0, "contrast": 0, "motion": 0, "drift": None}
    # an unweighted component is held out (and its statistic of the same name is not reported twice)
    h = HeldOut(spec, _reward("brightness,color", '{"color": 1}'))
    assert h.components == ("brightness",) and h.senses["brightness"] == 1 and "color" not in h.senses
    # a world reward's caption kinds (and the agreement that includes them) are not held out
    w = parse_validation_metrics(["world"], ["world_color_share"], ["a small red circle moves right on a blue "
                                                                     "background"])
    names = HeldOut(w, _reward("world_color_share")).names
    assert "world_caption_color" not in names and "world_caption_agreement" not in names
    assert {"world_caption_shape", "world_shape_fidelity", "world_background_cleanliness"} <= set(names)
    assert len(HeldOut(w, _reward("world_size")).names) == len(WORLD_METRICS) - 2
    assert not any(n.startswith("world_caption") for n in HeldOut(w, _reward("world_caption")).names)


def test_held_out_scores_of_a_rendered_world_clip():
    from sage_grpo.world.render import render_caption

    caption = "a large red square moves right on a blue background"
    clip = render_caption(caption, seed=0)  # [F, 3, H, W]
    spec = parse_validation_metrics(["auto"], ["brightness"], [caption])
    h = HeldOut(spec, _reward("brightness"))
    ref = drift_frames(clip)
    out = h.score(clip, caption, {"total": 0.3, "brightness": 0.3}, ref)
    assert list(out) == h.names
    for kind in ("background", "color", "shape", "size", "motion", "agreement"):
        assert out[f"world_caption_{kind}"] == 1.0, kind  # the detectors read a rendered clip exactly
    assert out["world_background_cleanliness"] > 0.9 and out["drift"] == 0.0
    assert out["drift"] < h.score(clip.flip(-1), caption, {}, ref)["drift"]  # a mirrored clip is far from it
    assert math.isnan(h.score(clip, caption, {}, None)["drift"])  # no reference: unknown, not 0


def test_video_statistics_on_known_videos():
    grey = torch.full((2, 3, 3, 8, 8), 0.4)
    s = video_statistics(grey)
    assert list(s) == list(STATISTICS)
    assert s["brightness"].tolist() == pytest.approx([0.4, 0.4]) and s["saturation"].tolist() == [0.0, 0.0]
    assert s["contrast"].tolist() == [0.0, 0.0] and s["motion"].tolist() == [0.0, 0.0]
    red = torch.zeros(1, 2, 3, 4, 4)
    red[:, :, 0] = 1.0
    red[:, 1, :, :2] = 1.0  # the second frame's top half white
    s = video_statistics(red)
    assert s["saturation"].item() == pytest.approx(0.75)  # 1 everywhere but the white quarter of the pixels
    assert s["motion"].item() == pytest.approx(2 / 3 * 0.5)  # one change: G and B by 1 on half of the pixels
    assert s["contrast"].item() == pytest.approx((0 + (1 - 0.299) / 2) / 2)


def test_drift_frames_are_small():
    x = drift_frames(torch.rand(81, 3, 480, 864))
    assert x.shape == (DRIFT_FRAMES, 3, DRIFT_HEIGHT, 230) and x.dtype == torch.float32
    small = torch.rand(5, 3, 32, 32)
    assert torch.equal(drift_frames(small), small)
