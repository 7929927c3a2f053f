"""CLIPScore and PickScore of a video against its prompt (frame-averaged), the visual metrics of Table 2.

Both load transformers' ``CLIPModel`` and the tokenizer from local directories (nothing is fetched); images are
preprocessed with torch only (no torchvision/PIL), following ``CLIPImageProcessor``: resize the shortest edge
(bicubic, antialiased), centre crop, rescale, normalise with the processor's mean/std.

* CLIPScore (Hessel et al. 2021): ``2.5 * max(cos(image, text), 0)`` per frame, with ``openai/clip-vit-large-patch14``.
* PickScore (Kirstain et al. 2023): ``exp(logit_scale) * cos(image, text)`` per frame, with
  ``yuvalkirstain/PickScore_v1`` weights and the ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` processor.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards.base import register_reward


def _read_processor_config(path: Path) -> dict:
    """Crop size, shortest edge, mean and std from ``preprocessor_config.json`` (CLIP defaults when absent)."""
    cfg = {}
    f = path / "preprocessor_config.json"
    if f.is_file():
        try:
            cfg = json.loads(f.read_text())
        except json.JSONDecodeError as err:
            raise SageGRPOError(f"{f} is not valid JSON ({err}): re-download the processor") from None
    size = cfg.get("size", 224)
    short = size.get("shortest_edge", size.get("height", 224)) if isinstance(size, dict) else int(size)
    crop = cfg.get("crop_size", short)
    crop_hw = (crop.get("height", short), crop.get("width", short)) if isinstance(crop, dict) else (int(crop),) * 2
    return {
        "shortest_edge": int(short),
        "crop": tuple(int(c) for c in crop_hw),
        "mean": tuple(cfg.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        "std": tuple(cfg.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
    }


def clip_preprocess(frames: torch.Tensor, pcfg: dict, quantize: bool = True) -> torch.Tensor:
    """Frames float [N, 3, H, W] in [0, 1] -> CLIP pixel values [N, 3, crop_h, crop_w] (on the same device)."""
    x = frames.float() * 255.0
    if quantize:
        x = x.round()
    H, W = x.shape[-2:]
    short = pcfg["shortest_edge"]
    # CLIPImageProcessor: the short side becomes `short`, the long side int(short * long / short_side)
    h, w = (short, int(short * W / H)) if H <= W else (int(short * H / W), short)
    if (h, w) != (H, W):
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    if quantize:
        x = x.round()
    x = x.clamp(0, 255)
    ch, cw = pcfg["crop"]
    top, left = max((h - ch) // 2, 0), max((w - cw) // 2, 0)
    x = x[..., top : top + ch, left : left + cw]  # [N, 3, ch, cw]
    mean = torch.tensor(pcfg["mean"], device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(pcfg["std"], device=x.device).view(1, 3, 1, 1)
    return (x / 255.0 - mean) / std


# Hugging Face hub ids of (model, processor) per metric; download_weights.sh `metrics` fetches them into
# <root>/clip-vit-large-patch14, <root>/PickScore_v1 and <root>/CLIP-ViT-H-14-laion2B-s32B-b79K.
HUB_IDS = {
    "clipscore": ("openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14"),
    "pickscore": ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"),
}


class ClipVideoScore:
    """Frame-averaged image-text similarity with a CLIP model; ``kind`` "clipscore" or "pickscore"."""

    def __init__(
        self,
        model_path: str | Path,
        processor_path: str | Path | None = None,
        kind: str = "clipscore",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        num_frames: int = 8,
    ):
        """Load ``CLIPModel`` from ``model_path``, tokenizer + image config from ``processor_path`` (default: same)."""
        from transformers import AutoTokenizer, CLIPModel

        if kind not in ("clipscore", "pickscore"):
            raise ValueError(f"kind must be clipscore or pickscore, got {kind!r}")
        self.kind = kind
        self.components = ("CLIPScore",) if kind == "clipscore" else ("PickScore",)
        self.default_weights = {self.components[0]: 1.0}
        model_path = Path(model_path)
        processor_path = Path(processor_path) if processor_path else model_path
        problems = _missing_clip_files(kind, model_path, processor_path)
        if problems:
            raise SageGRPOError(problems[0])
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_frames = int(num_frames)
        try:
            self.model = CLIPModel.from_pretrained(str(model_path), dtype=dtype).to(self.device).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(str(processor_path))
        except Exception as err:  # noqa: BLE001
            raise SageGRPOError(f"cannot load {kind} from {model_path} / {processor_path}: {err}") from None
        self.model.requires_grad_(False)
        self.pcfg = _read_processor_config(processor_path)

    @torch.no_grad()
    def text_embeds(self, prompts: Sequence[str]) -> torch.Tensor:
        """Unit-norm text embeddings [B, E]."""
        max_len = int(getattr(self.model.config.text_config, "max_position_embeddings", 77))
        tok = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        out = self.model.text_model(input_ids=tok["input_ids"].to(self.device),
                                    attention_mask=tok["attention_mask"].to(self.device))  # fmt: skip
        return F.normalize(self.model.text_projection(out.pooler_output).float(), dim=-1)

    @torch.no_grad()
    def image_embeds(self, frames: torch.Tensor) -> torch.Tensor:
        """Unit-norm image embeddings of frames [N, 3, H, W] in [0, 1] -> [N, E]."""
        px = clip_preprocess(frames.to(self.device), self.pcfg).to(self.dtype)
        out = self.model.vision_model(pixel_values=px)
        return F.normalize(self.model.visual_projection(out.pooler_output).float(), dim=-1)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {CLIPScore or PickScore: float32 [B]} (mean over sampled frames)."""
        B, nf = videos.shape[:2]
        n = nf if self.num_frames <= 0 else min(self.num_frames, nf)
        idx = torch.linspace(0, nf - 1, n).round().long().to(videos.device)
        frames = videos.index_select(1, idx).flatten(0, 1)  # [B*n, 3, H, W]
        img = self.image_embeds(frames).view(B, n, -1)  # [B, n, E]
        txt = self.text_embeds(prompts)  # [B, E]
        cos = (img * txt[:, None]).sum(-1)  # [B, n]
        if self.kind == "clipscore":
            per_frame = 2.5 * cos.clamp(min=0)
        else:
            per_frame = self.model.logit_scale.exp().float() * cos
        return {self.components[0]: per_frame.mean(dim=1).to(videos.device)}


def _missing_clip_files(kind: str, model_path: str | Path, processor_path: str | Path | None) -> list[str]:
    model_path = Path(model_path)
    processor_path = Path(processor_path) if processor_path else model_path
    problems = []
    for p, what, hub in ((model_path, "model", HUB_IDS[kind][0]), (processor_path, "processor", HUB_IDS[kind][1])):
        if what == "processor" and p == model_path:
            continue  # one folder for both: said once
        if not (p / "config.json").is_file() and not (p / "tokenizer_config.json").is_file():
            problems.append(f"{kind} {what} directory {p} has no config/tokenizer files: download {hub} there "
                            f"(hf download {hub} --local-dir {p}; ./download_weights.sh metrics fetches all three "
                            "into ckpts/)")
    return problems


@register_reward("clipscore")
def build_clipscore(
    clip_model_path: str | Path = "",
    pretrained_model_root: str | Path = "ckpts",
    device: str | torch.device = "cpu",
    clip_num_frames: int = 8,
    **_: object,
) -> ClipVideoScore:
    """Builder: ``clip_model_path`` defaults to <pretrained_model_root>/clip-vit-large-patch14."""
    path = clip_model_path or Path(pretrained_model_root) / "clip-vit-large-patch14"
    return ClipVideoScore(path, None, "clipscore", device, num_frames=clip_num_frames)


@register_reward("pickscore")
def build_pickscore(
    pickscore_model_path: str | Path = "",
    pickscore_processor_path: str | Path = "",
    pretrained_model_root: str | Path = "ckpts",
    device: str | torch.device = "cpu",
    clip_num_frames: int = 8,
    **_: object,
) -> ClipVideoScore:
    """Builder: defaults <root>/PickScore_v1 (model) and <root>/CLIP-ViT-H-14-laion2B-s32B-b79K (processor)."""
    root = Path(pretrained_model_root)
    model = pickscore_model_path or root / "PickScore_v1"
    proc = pickscore_processor_path or root / "CLIP-ViT-H-14-laion2B-s32B-b79K"
    return ClipVideoScore(model, proc, "pickscore", device, num_frames=clip_num_frames)


# what post_train.py's preflight asks (sage_grpo.rewards.missing_reward_files): the directories, no model loaded
build_clipscore.check_files = lambda clip_model_path="", pretrained_model_root="ckpts", **_: _missing_clip_files(
    "clipscore", clip_model_path or Path(pretrained_model_root) / "clip-vit-large-patch14", None)
build_pickscore.check_files = (
    lambda pickscore_model_path="", pickscore_processor_path="", pretrained_model_root="ckpts", **_:
    _missing_clip_files("pickscore", pickscore_model_path or Path(pretrained_model_root) / "PickScore_v1",
                        pickscore_processor_path or Path(pretrained_model_root) / "CLIP-ViT-H-14-laion2B-s32B-b79K"))
