"""A tiny judge whose answer depends on the frames (`write_tiny_frame_judge`): its greedy answer tracks the property
it reads, as its reference computation says; and (slow) training the tiny world model through it, served by
`transformers serve`, raises its score on held-out captions (scripts/bench_judge_learning.py --quick)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import ROOT, load_script
from PIL import Image

from sage_grpo.rewards.tiny import (
    FRAME_JUDGE_RANGE,
    LUMA,
    frame_judge_digit,
    frame_judge_property,
    write_tiny_frame_judge,
)


def answer(model, processor, images: list[Image.Image]) -> tuple[str, torch.Tensor]:
    """(the judge's greedy answer to a judging chat about ``images``, their patches' mean lumas [images, patches] as
    the processor resized them)."""
    msgs = [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                         {"type": "text", "text": "Rate this video from 1 to 10. Number only."}]}]
    inputs = processor(images=images, text=processor.apply_chat_template(msgs, add_generation_prompt=True),
                       return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    ip = processor.image_processor
    pixels = inputs["pixel_values"].double() * torch.tensor(ip.image_std).view(1, 3, 1, 1) + \
        torch.tensor(ip.image_mean).view(1, 3, 1, 1)  # [n, 3, 28, 28], the processor's normalisation undone
    luma = (pixels * torch.tensor(LUMA, dtype=torch.float64).view(1, 3, 1, 1)).sum(1, keepdim=True)
    patch = model.config.vision_config.patch_size
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:]), \
        torch.nn.functional.avg_pool2d(luma, patch).flatten(1)


def square(side: int, fg=(255, 255, 0), bg=(0, 0, 200)) -> Image.Image:
    """A 32 x 32 frame: a centred square of ``side`` pixels on a plain background."""
    a = np.empty((32, 32, 3), np.uint8)
    a[:] = bg
    o = (32 - side) // 2
    a[o:o + side, o:o + side] = fg
    return Image.fromarray(a)


@pytest.mark.parametrize("reads", ["brightness", "contrast"])
def test_the_frame_judge_answers_a_digit_that_rises_with_what_it_reads(reads, tmp_path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    d = write_tiny_frame_judge(tmp_path / reads, reads=reads)
    processor, model = AutoProcessor.from_pretrained(d), LlavaForConditionalGeneration.from_pretrained(d).eval()
    lo, hi = FRAME_JUDGE_RANGE[reads]
    if reads == "brightness":  # plain frames of 5 lumas, 4 frames a chat
        chats = [[Image.fromarray(np.full((32, 32, 3), round(v * 255), np.uint8))] * 4
                 for v in (0.1, 0.35, 0.5, 0.65, 0.9)]
    else:  # a square growing to half the frame's side, the last frame of the 4 larger than the others
        chats = [[square(s)] * 3 + [square(s + 2)] for s in (0, 4, 8, 12, 16)]
    digits = []
    for images in chats:
        text, patch_luma = answer(model, processor, images)
        assert text == f"{frame_judge_digit(patch_luma, reads, lo, hi)}<|im_end|>", text  # the reference's digit
        digits.append(int(text[0]))
    assert digits == sorted(digits) and len(set(digits)) >= 4 and digits[0] == 1, digits
    # the reference is the model's own feature: the image tokens' first dimension, averaged
    with torch.no_grad():
        inputs = processor(images=chats[2], text="<image>" * 4, return_tensors="pt")
        feats = torch.cat(list(model.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output))
    want = frame_judge_property(answer(model, processor, chats[2])[1], reads, lo, hi)
    assert feats[:, 0].double().mean().item() == pytest.approx(want.item(), abs=2e-3)


def test_the_frame_judge_ignores_the_text_and_a_bad_property_is_refused(tmp_path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    d = write_tiny_frame_judge(tmp_path / "j", reads="contrast")
    processor, model = AutoProcessor.from_pretrained(d), LlavaForConditionalGeneration.from_pretrained(d).eval()
    images = [square(10)] * 2
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": t}]}
            for t in ("short", "a much longer judging request, " * 20)]
    got = set()
    for m in msgs:
        inputs = processor(images=images, text=processor.apply_chat_template([m], add_generation_prompt=True),
                           return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        got.add(processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:]))
    assert len(got) == 1
    with pytest.raises(ValueError, match="reads must be one of"):
        write_tiny_frame_judge(tmp_path / "x", reads="size")
    with pytest.raises(ValueError, match="lo < hi"):
        write_tiny_frame_judge(tmp_path / "x", lo=0.5, hi=0.5)


bj = load_script("scripts/bench_judge_learning.py")


def test_the_rise_and_its_standard_errors_equal_numpy():
    rng = np.random.default_rng(0)
    base = {"judge": rng.uniform(0, 1, 16).tolist()}
    after = [np.array(base["judge"]) + rng.normal(0.05, 0.1, 16) for _ in range(3)]
    table = bj.aggregate(base, [{"seed": s, "scores": {"judge": a.tolist()}} for s, a in enumerate(after)])
    rises = [a - np.array(base["judge"]) for a in after]
    for s, r in enumerate(rises):
        got = table["judge"]["per_seed"][s]["rise"]
        assert got["mean"] == pytest.approx(r.mean()) and got["se"] == pytest.approx(r.std(ddof=1) / 4)
    over = table["judge"]["rise"]
    means = np.array([r.mean() for r in rises])
    assert over["mean"] == pytest.approx(means.mean()) and over["se"] == pytest.approx(means.std(ddof=1) / 3 ** 0.5)
    assert over["std_errors"] == pytest.approx(over["mean"] / over["se"])
    pooled, diffs = table["judge"]["pooled"], np.concatenate(rises)  # every seed's paired differences
    assert pooled["n"] == 48 and pooled["mean"] == pytest.approx(diffs.mean())
    assert pooled["se"] == pytest.approx(diffs.std(ddof=1) / 48 ** 0.5)
    assert len(bj.format_table(table).splitlines()) == 2 + 3 + 1


@pytest.mark.slow
def test_training_through_the_served_frame_judge_reaches_it_and_is_evaluated(tmp_path, monkeypatch):
    """--quick: 1 seed, 2 GRPO steps, 4 held-out captions x 1 noise, the same noise before and after. Asserts that
    every training request reached the judge (the probe + 8 videos a step), that the judge's answers differ between
    the base model's videos (the frames decide them), that no training video failed and that the rise was measured.
    It does not assert a rise: 2 or 3 steps move a held-out video's digit either way (one 3-step run went 3 4 5 4
    -> 3 4 5 3); the rise is measured over 3 seeds by the full script."""
    monkeypatch.chdir(ROOT)
    summary = bj.main(["--quick", "--out", str(tmp_path)])
    run = summary["runs"][0]
    assert run["train_requests"] == 1 + 8 * summary["steps"]
    assert len(set(summary["base_scores"]["judge"])) > 1
    rows = [json.loads(line) for line in (tmp_path / "runs" / "s0" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["reward/failed"] == 0 for r in rows)
    assert math.isfinite(summary["table"]["judge"]["per_seed"][0]["rise"]["mean"])
