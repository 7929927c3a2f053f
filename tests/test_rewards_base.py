"""Reward protocol pieces without models: registry, weights parsing, composite arithmetic, NaN handling, demo
rewards."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards import SETTING_A, SETTING_B, CompositeReward, build_reward, parse_reward_weights, reward_names
from sage_grpo.rewards.base import get_reward_builder, score_safely
from sage_grpo.rewards.builtin import BrightnessReward, ColorReward, TemporalConsistencyReward

VALID = ("VQ", "MQ", "TA", "Overall", "VQ_raw", "MQ_raw", "TA_raw")


class Table:
    """A fake reward returning fixed per-video numbers; raises for prompts containing 'boom'."""

    def __init__(self, values: dict[str, list[float]]):
        """``values``: component -> per-video list (indexed by the int in the prompt)."""
        self.values = values
        self.components = tuple(values)
        self.default_weights = {self.components[0]: 1.0}

    def __call__(self, videos, prompts):
        """Look up by prompt index; raise on 'boom'."""
        if any("boom" in p for p in prompts):
            raise RuntimeError("model exploded")
        idx = [int(p.split()[-1]) for p in prompts]
        return {c: torch.tensor([v[i] for i in idx]) for c, v in self.values.items()}


def vids(b: int) -> torch.Tensor:
    """Dummy videos [b, 2, 3, 4, 4]."""
    return torch.zeros(b, 2, 3, 4, 4)


def test_registry_names_and_unknown_name():
    """All rewards are registered; an unknown name lists the valid ones."""
    assert {"videoalign_local", "clipscore", "pickscore", "brightness", "color", "temporal_consistency"} <= set(
        reward_names()
    )
    with pytest.raises(SageGRPOError, match="unknown reward 'videoalign'.*valid names.*videoalign_local"):
        get_reward_builder("videoalign")
    with pytest.raises(SageGRPOError, match="unknown reward"):
        build_reward(reward_model="brightness,nope", reward_weights=None)


def test_parse_weights_case_insensitive_and_errors():
    """Keys match case-insensitively; bad JSON, unknown keys, duplicates and non-numbers fail clearly."""
    assert parse_reward_weights('{"vq":0.5,"Mq":0.5,"TA":1}', VALID) == {"VQ": 0.5, "MQ": 0.5, "TA": 1.0}
    assert parse_reward_weights(SETTING_A, VALID) == {"VQ": 1.0, "MQ": 1.0, "TA": 1.0}
    assert parse_reward_weights(SETTING_B, VALID) == {"VQ": 0.5, "MQ": 0.5, "TA": 1.0}
    assert parse_reward_weights("", VALID) is None and parse_reward_weights(None, VALID) is None
    with pytest.raises(SageGRPOError, match="not valid JSON.*double quotes"):
        parse_reward_weights("{'VQ': 1}", VALID)
    with pytest.raises(SageGRPOError, match="unknown component 'XQ'.*VQ, MQ, TA"):
        parse_reward_weights('{"XQ": 1}', VALID)
    with pytest.raises(SageGRPOError, match="twice"):
        parse_reward_weights('{"VQ": 1, "vq": 2}', VALID)
    for bad in ('{"VQ": "1"}', '{"VQ": true}', '{"VQ": NaN}'):
        with pytest.raises(SageGRPOError, match="finite number"):
            parse_reward_weights(bad, VALID)
    with pytest.raises(SageGRPOError, match="non-empty JSON object"):
        parse_reward_weights("[1, 2]", VALID)


def test_composite_weights_applied_exactly():
    """total = sum w_k c_k, checked against a hand computation; zero weights stay out of the total."""
    a = Table({"VQ": [1.0, -2.0, 0.25], "MQ": [0.5, 0.5, 4.0]})
    b = Table({"TA": [3.0, 1.0, -1.0]})
    comp = CompositeReward({"a": a, "b": b}, parse_reward_weights('{"vq":0.5,"mq":0.5,"ta":1.0}', ("VQ", "MQ", "TA")))
    out = comp(vids(3), ["p 0", "p 1", "p 2"])
    hand = [0.5 * 1.0 + 0.5 * 0.5 + 3.0, 0.5 * -2.0 + 0.5 * 0.5 + 1.0, 0.5 * 0.25 + 0.5 * 4.0 - 1.0]
    assert out["total"].tolist() == hand  # exact: these are all binary fractions
    assert out["VQ"].tolist() == [1.0, -2.0, 0.25] and out["TA"].tolist() == [3.0, 1.0, -1.0]
    nan_mq = Table({"VQ": [1.0, 2.0, 3.0], "MQ": [math.nan, 0.0, 0.0]})
    out = CompositeReward({"a": nan_mq}, {"VQ": 2.0, "MQ": 0.0})(vids(3), ["p 0", "p 1", "p 2"])
    assert out["total"].tolist() == [2.0, 4.0, 6.0] and math.isnan(out["MQ"][0])
    out = CompositeReward({"a": nan_mq}, {"VQ": 1.0, "MQ": 1.0})(vids(3), ["p 0", "p 1", "p 2"])
    assert math.isnan(out["total"][0]) and out["total"][1:].tolist() == [2.0, 3.0]
    with pytest.raises(SageGRPOError, match="all reward weights are 0"):
        CompositeReward({"a": a}, {"VQ": 0.0})
    # default weights: each reward's own
    assert CompositeReward({"a": a, "b": b}).weights == {"VQ": 1.0, "TA": 1.0}


def test_failed_video_is_nan_and_others_survive():
    """A raise on one video: the batch falls back to per-video scoring; only that video is NaN (never 0)."""
    r = Table({"VQ": [1.0, 2.0, 3.0]})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = score_safely(r, vids(3), ["p 0", "boom 1", "p 2"])
    assert out["VQ"][0] == 1.0 and math.isnan(out["VQ"][1]) and out["VQ"][2] == 3.0
    assert any("video 1" in str(x.message) for x in w)
    inf = Table({"VQ": [math.inf, -math.inf, 1.0]})
    out = score_safely(inf, vids(3), ["p 0", "p 1", "p 2"])
    assert math.isnan(out["VQ"][0]) and math.isnan(out["VQ"][1]) and out["VQ"][2] == 1.0

    class WrongShape(Table):
        """Returns [1] instead of [B]."""

        def __call__(self, videos, prompts):
            """Always one value."""
            return {"VQ": torch.ones(1)}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = score_safely(WrongShape({"VQ": [0.0]}), vids(2), ["p 0", "p 1"])
    assert out["VQ"].shape == (2,) and torch.isnan(out["VQ"]).sum() == 0  # per-video calls do return [1]
    with pytest.raises(ValueError, match="2 videos but 1 prompts"):
        score_safely(r, vids(2), ["p 0"])


def _const_video(rgb, f=3, h=4, w=5):
    """A video whose every pixel is ``rgb``: [1, f, 3, h, w]."""
    return torch.tensor(rgb, dtype=torch.float32).view(1, 1, 3, 1, 1).expand(1, f, 3, h, w).clone()


def test_brightness_against_bt601():
    """Constant colours give exactly 0.299 R + 0.587 G + 0.114 B; a half-white video gives half."""
    for rgb in ((0, 0, 0), (1, 1, 1), (1, 0, 0), (0.2, 0.4, 0.6)):
        got = BrightnessReward()(_const_video(rgb), [""])["brightness"].item()
        assert got == pytest.approx(0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2], abs=1e-6)
    v = torch.zeros(1, 2, 3, 4, 4)
    v[:, :, :, :2] = 1.0
    assert BrightnessReward()(v, [""])["brightness"].item() == pytest.approx(0.5, abs=1e-6)


def test_color_reward_against_distance():
    """1 at the target colour, 0 at the opposite corner of the RGB cube, closed form in between."""
    r = ColorReward((1.0, 0.0, 0.0))
    assert r(_const_video((1, 0, 0)), [""])["color"].item() == pytest.approx(1.0)
    assert r(_const_video((0, 1, 1)), [""])["color"].item() == pytest.approx(0.0, abs=1e-6)
    got = r(_const_video((0.5, 0.5, 0.0)), [""])["color"].item()
    assert got == pytest.approx(1 - math.sqrt(0.25 + 0.25) / math.sqrt(3), abs=1e-6)
    redder = ColorReward()(_const_video((0.8, 0.3, 0.3)), [""])["color"]
    greyer = ColorReward()(_const_video((0.5, 0.5, 0.5)), [""])["color"]
    assert redder > greyer  # the default target is red: reddening is rewarded
    with pytest.raises(SageGRPOError, match="3 numbers in"):
        ColorReward((2.0, 0.0, 0.0))


def test_temporal_consistency_against_loop():
    """Equals -mean |x_{t+1}-x_t| computed by an explicit loop; still video 0, flicker between 0 and 1 gives -1."""
    g = torch.Generator().manual_seed(0)
    v = torch.rand(2, 5, 3, 6, 7, generator=g)
    got = TemporalConsistencyReward()(v, ["", ""])["temporal_consistency"]
    for b in range(2):
        diffs = [(v[b, t + 1] - v[b, t]).abs().mean().item() for t in range(4)]
        assert got[b].item() == pytest.approx(-sum(diffs) / 4, abs=1e-6)
    assert TemporalConsistencyReward()(_const_video((0.3, 0.3, 0.3)), [""])["temporal_consistency"].item() == 0.0
    flicker = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)] * 2).unsqueeze(0)
    assert TemporalConsistencyReward()(flicker, [""])["temporal_consistency"].item() == pytest.approx(-1.0)
    assert TemporalConsistencyReward()(torch.rand(1, 1, 3, 4, 4), [""])["temporal_consistency"].item() == 0.0


def test_build_reward_with_demo_rewards():
    """build_reward combines several demo rewards by name with JSON weights, on tiny 32x32 videos."""
    r = build_reward(
        reward_model="brightness, temporal_consistency", reward_weights='{"BRIGHTNESS": 2, "temporal_consistency": 1}'
    )
    v = torch.rand(2, 5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = r(v, ["a", "b"])
    torch.testing.assert_close(out["total"], 2 * out["brightness"] + out["temporal_consistency"])
    with pytest.raises(SageGRPOError, match="unknown component 'VQ'"):
        build_reward(reward_model="color", reward_weights=SETTING_B)
    assert build_reward(reward_model="color", reward_weights="").weights == {"color": 1.0}


def test_negative_weight_applies_a_penalty():
    """A negative weight subtracts its component: total = 1 * VQ - 0.5 * TA."""
    r = Table({"VQ": [1.0, 2.0, 0.5], "TA": [3.0, 4.0, -1.0]})
    out = CompositeReward({"a": r}, parse_reward_weights('{"VQ": 1, "TA": '
                                                         '-0.5}', ("VQ", "TA")))(vids(3), ["p 0", "p 1", "p 2"])
    assert out["total"].tolist() == [1.0 - 1.5, 2.0 - 2.0, 0.5 + 0.5]


def test_empty_weights_and_a_component_named_total_are_refused():
    with pytest.raises(SageGRPOError, match="non-empty JSON object"):
        parse_reward_weights("{}", VALID)
    with pytest.raises(SageGRPOError, match="'total', which is reserved"):
        CompositeReward({"a": Table({"total": [1.0], "VQ": [2.0]})})


class PixelMean:
    """Scores each video by its own mean pixel value; refuses batches of more than one video (a batch failure)."""

    components = ("mean",)
    default_weights = {"mean": 1.0}

    def __call__(self, videos, prompts):
        if videos.shape[0] > 1:
            raise RuntimeError("out of memory")
        return {"mean": videos.mean(dim=(1, 2, 3, 4))}


def test_per_video_fallback_scores_each_video_itself():
    """After the batch fails, video i is scored from videos[i] (a reward that reads its input would notice)."""
    v = torch.stack([torch.full((2, 3, 4, 4), x) for x in (0.1, 0.5, 0.9)])  # [3, 2, 3, 4, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = score_safely(PixelMean(), v, ["a", "b", "c"])
    assert out["mean"].tolist() == pytest.approx([0.1, 0.5, 0.9])


def test_brightness_clamps_out_of_range_pixels():
    """Pixels outside [0, 1] (a decoder overshoot) count as 0 or 1: luma stays in [0, 1]."""
    assert BrightnessReward()(_const_video((2.0, 2.0, 2.0)), [""])["brightness"].item() == pytest.approx(1.0)
    assert BrightnessReward()(_const_video((-1.0, -1.0, -1.0)), [""])["brightness"].item() == pytest.approx(0.0)
    got = BrightnessReward()(_const_video((1.5, -0.5, 0.5)), [""])["brightness"].item()
    assert got == pytest.approx(0.299 * 1.0 + 0.587 * 0.0 + 0.114 * 0.5, abs=1e-6)


def test_optional_components_are_named_case_insensitively_and_checked():
    """--reward_optional: names match the components case-insensitively; an unknown one is one error line naming
    the valid ones; the logged total stays the plain weighted sum (NaN where a weighted component failed)."""
    reward = CompositeReward({"t": Table({"VQ": [1.0, 2.0], "TA": [float("nan"), 3.0]})}, {"VQ": 1.0, "TA": 2.0},
                             optional=[" ta "])
    assert reward.optional == frozenset({"TA"})
    out = reward(vids(2), ["0", "1"])
    assert math.isnan(out["total"][0]) and out["total"][1].item() == 1.0 * 2.0 + 2.0 * 3.0
    assert CompositeReward({"t": Table({"VQ": [1.0]})}).optional == frozenset()
    with pytest.raises(SageGRPOError, match=r"--reward_optional names an unknown component 'MQ'.*VQ, TA"):
        CompositeReward({"t": Table({"VQ": [1.0], "TA": [1.0]})}, {"VQ": 1.0}, optional=["MQ"])
