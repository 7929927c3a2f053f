"""CLIPScore / PickScore with tiny random CLIP models: preprocessing, formula, frame averaging, registry use."""

from __future__ import annotations

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards import build_reward
from sage_grpo.rewards.clip_metrics import ClipVideoScore, _read_processor_config, clip_preprocess

PROMPTS = ["a red fox", "a blue whale in the ocean"]


def _videos() -> torch.Tensor:
    """Two 5-frame 40x48 random videos."""
    return torch.rand(2, 5, 3, 40, 48, generator=torch.Generator().manual_seed(0))


def test_clip_preprocess_matches_transformers_pil_processor(tiny_clip_dirs):  # noqa: F811
    """Resize-shortest-edge + centre-crop + normalise equals CLIPImageProcessor up to bicubic kernel differences.

    PIL's bicubic (a = -0.5) differs from torch's (a = -0.75) by a few grey levels on random pixels; on frames that
    need no resize the two must agree exactly.
    """
    from transformers import CLIPImageProcessorPil

    pcfg = _read_processor_config(tiny_clip_dirs["clip"])
    assert pcfg["shortest_edge"] == 32 and pcfg["crop"] == (28, 28)
    ref_proc = CLIPImageProcessorPil.from_pretrained(str(tiny_clip_dirs["clip"]))
    frame = torch.rand(3, 32, 40, generator=torch.Generator().manual_seed(3))  # short side already 32
    u8 = (frame * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    ref = ref_proc(images=[u8], return_tensors="pt")["pixel_values"]
    ours = clip_preprocess(frame[None], pcfg)
    assert ours.shape == ref.shape == (1, 3, 28, 28)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    big = torch.rand(1, 3, 64, 80, generator=torch.Generator().manual_seed(4))
    ref_big = ref_proc(images=[(big[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()], return_tensors="pt")
    diff = (clip_preprocess(big, pcfg) - ref_big["pixel_values"]).abs()
    assert diff.mean() < 0.1  # ~ a few grey levels after /std


def test_clipscore_formula_against_clipmodel_logits(tiny_clip_dirs):  # noqa: F811
    """CLIPScore = mean over frames of 2.5 * max(cos, 0), cos taken from CLIPModel's own logits / logit_scale."""
    r = ClipVideoScore(tiny_clip_dirs["clip"], kind="clipscore", num_frames=0)
    v = _videos()
    got = r(v, PROMPTS)["CLIPScore"]
    tok = r.tokenizer(PROMPTS, padding=True, return_tensors="pt")
    for b in range(2):
        px = clip_preprocess(v[b], r.pcfg)  # [5, 3, 28, 28]
        with torch.no_grad():
            out = r.model(input_ids=tok["input_ids"][b : b + 1], attention_mask=tok["attention_mask"][b : b + 1],
                          pixel_values=px)  # fmt: skip
        cos = out.logits_per_image[:, 0] / r.model.logit_scale.exp()  # [5]
        assert got[b].item() == pytest.approx((2.5 * cos.clamp(min=0)).mean().item(), abs=1e-5)


def test_pickscore_uses_separate_processor_and_logit_scale(tiny_clip_dirs):  # noqa: F811
    """PickScore = exp(logit_scale) * cos averaged over frames, with the processor dir's mean/std."""
    r = ClipVideoScore(tiny_clip_dirs["pick_model"], tiny_clip_dirs["pick_processor"], kind="pickscore", num_frames=3)
    assert r.pcfg["mean"] == (0.5, 0.5, 0.5)
    v = _videos()
    got = r(v, PROMPTS)["PickScore"]
    idx = torch.linspace(0, 4, 3).round().long()
    img = r.image_embeds(v[:, idx].flatten(0, 1)).view(2, 3, -1)
    txt = r.text_embeds(PROMPTS)
    want = (r.model.logit_scale.exp() * torch.einsum("bne,be->bn", img, txt)).mean(1)
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got).all() and torch.equal(got, r(v, PROMPTS)["PickScore"])


def test_clip_metrics_as_rewards_and_errors(tiny_clip_dirs, tmp_path):  # noqa: F811
    """Both metrics build by name via build_reward; missing directories fail with a clear message."""
    root = tiny_clip_dirs["root"]
    r = build_reward(
        reward_model="clipscore,pickscore,brightness",
        reward_weights='{"clipscore": 1, "PICKSCORE": 0.01}',
        clip_model_path=str(root / "clip-vit-large-patch14"),
        pickscore_model_path=str(root / "PickScore_v1"),
        pickscore_processor_path=str(root / "CLIP-ViT-H-14"),
    )
    out = r(_videos(), PROMPTS)
    torch.testing.assert_close(out["total"], out["CLIPScore"] + 0.01 * out["PickScore"])
    with pytest.raises(SageGRPOError, match="clipscore model directory"):
        ClipVideoScore(tmp_path / "none", kind="clipscore")
