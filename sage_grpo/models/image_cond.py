"""Image-to-video conditioning: each prompt's reference image, encoded once, handed to every forward of its samples.

What HunyuanVideo-1.5 I2V takes besides the text (diffusers 0.42.1 `HunyuanVideo15ImageToVideoPipeline`, checked
against the authors' code; /work/shared/spec/hv15_variants.md section 1):
- the size comes from the image: `calculate_default_height_width(h, w, transformer.config.target_size)` picks the
  bucket of the closest aspect ratio (640 for the 480p checkpoints: 16:9 -> 480 x 848), then resize-to-cover and a
  centre crop;
- the condition latent is the VAE *mode* of the cropped image times `scaling_factor`, in latent frame 0 of the 32
  condition channels (frames 1.. zero), and the mask channel is 1 at frame 0: input = [noisy 32, cond 32, mask 1];
- `image_embeds` is SigLIP's `last_hidden_state` of the cropped image (SigLIP's processor squashes it to 384 x 384);
- CFG's negative branch changes only the text: image embeds, condition and mask are the same in both branches.

diffusers' pipeline takes one image per call, and the authors' GRPO code one image per batch (`ref_image_paths[0]`),
so every group after the first on a rank trained on the wrong image. Here each sample carries its own image's
conditioning (`ImageConditioning`, batched like `TextConditioning`), computed once per distinct image by
`ImageConditioningCache` (the authors encode it again at every training micro-step) and kept on CPU beside the text
embeddings; the image encoder is offloaded afterwards like the text encoders. A forward holds one task and one size:
the transformer decides T2V vs I2V once per batch (`torch.all(image_embeds == 0)`), and latents of different sizes
do not stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from sage_grpo.errors import SageGRPOError

__all__ = [
    "ImageConditioning",
    "ImageConditioningCache",
    "open_reference_image",
    "check_reference_images",
    "bucket_size",
    "condition_channels",
    "check_task",
]


@dataclass
class ImageConditioning:
    """Reference-image conditioning of N samples (one size for all)."""

    latents: Tensor  # [N, C, 1, h, w] VAE mode of the bucket-cropped image x scaling_factor (latent frame 0)
    embeds: Tensor  # [N, T_img, D_img] SigLIP last_hidden_state of the same crop

    def __len__(self) -> int:
        return self.latents.shape[0]

    @property
    def latent_hw(self) -> tuple[int, int]:
        return int(self.latents.shape[-2]), int(self.latents.shape[-1])

    def to(self, device=None, dtype: torch.dtype | None = None) -> ImageConditioning:
        return ImageConditioning(self.latents.to(device=device, dtype=dtype),
                                 self.embeds.to(device=device, dtype=dtype))

    def index(self, idx: Tensor | list[int] | slice) -> ImageConditioning:
        return ImageConditioning(self.latents[idx], self.embeds[idx])

    @staticmethod
    def cat(items: list[ImageConditioning]) -> ImageConditioning:
        sizes = {c.latent_hw for c in items}
        if len(sizes) > 1:
            raise SageGRPOError(f"reference images of different bucket sizes in one batch (latent sizes "
                                f"{sorted(sizes)}): one forward holds one size")
        return ImageConditioning(torch.cat([c.latents for c in items]), torch.cat([c.embeds for c in items]))


def condition_channels(image: ImageConditioning | None, x: Tensor) -> tuple[Tensor, Tensor]:
    """The transformer's condition latent and mask for noisy latents x [B, C, F, H, W] -> ([B, C, F, H, W],
    [B, 1, F, H, W]) in x's dtype: the image latent in frame 0 and mask 1 there (I2V), all zeros (T2V, image None).
    Frame 0 of x itself is left alone: HunyuanVideo-1.5 denoises it like every other frame (not pasted)."""
    cond = torch.zeros_like(x)  # [B, C, F, H, W]
    mask = torch.zeros_like(x[:, :1])  # [B, 1, F, H, W]
    if image is None:
        return cond, mask
    if len(image) != x.shape[0] or image.latents.shape[1] != x.shape[1] or image.latent_hw != tuple(x.shape[-2:]):
        raise ValueError(f"image conditioning {tuple(image.latents.shape)} does not fit latents {tuple(x.shape)}")
    cond[:, :, :1] = image.latents.to(x.device, x.dtype)  # frame 0 only; frames 1.. stay zero
    mask[:, :, 0] = 1.0
    return cond, mask


# ------------------------------------------------------------------------------------------------ reading images


def open_reference_image(path: str | Path, where: str = ""):
    """The reference image at `path`, decoded whole and converted to RGB (PIL.Image). A missing, unreadable or
    corrupt file is one SageGRPOError naming it (and `where` it was given: a prompt file row, a flag)."""
    import PIL.Image

    path = Path(path)
    at = f" ({where})" if where else ""
    if not path.is_file():
        raise SageGRPOError(f"reference image {path}{at} does not exist" if not path.exists()
                            else f"reference image {path}{at} is not a file")
    try:
        with PIL.Image.open(path) as im:
            im.load()  # decode every pixel now: a truncated file fails here, not in the middle of a run
            return im.convert("RGB")
    except OSError as e:  # PIL's UnidentifiedImageError and truncation errors are OSErrors, as is a permission error
        reason = e.strerror or str(e) or type(e).__name__
        raise SageGRPOError(f"reference image {path}{at} cannot be read as an image: {reason}") from None
    except Exception as e:  # noqa: BLE001 -- a decoder's own error (e.g. a corrupt PNG chunk) is one line too
        raise SageGRPOError(f"reference image {path}{at} is corrupt: {type(e).__name__}: {e}") from None


def check_reference_images(records, source: str = "") -> None:
    """Preflight: every distinct `ref_image_path` of `records` opens and decodes (no model needed)."""
    seen = set()
    for rec in records:
        p = getattr(rec, "ref_image_path", None)
        if p and p not in seen:
            seen.add(p)
            what = f"prompt {rec.prompt[:40]!r}"
            open_reference_image(p, f"{source}, {what}" if source else what)


def check_task(task: str, records, source: str) -> None:
    """The prompts fit the checkpoint's task: an I2V checkpoint needs a reference image for every prompt, a T2V one
    takes none (it has no image encoder; silently ignoring the images would train text-to-video). source: where the
    prompts come from, for the message (a prompt file, a flag)."""
    with_image = [r for r in records if getattr(r, "ref_image_path", None)]
    if task == "t2v" and with_image:
        raise SageGRPOError(f"{source} gives reference images (ref_image_path, e.g. {with_image[0].ref_image_path}) "
                            "but the checkpoint is text-to-video; use an image-to-video checkpoint (e.g. 480p_i2v) or "
                            "drop the images")
    if task == "i2v" and len(with_image) < len(records):
        missing = next(r for r in records if not getattr(r, "ref_image_path", None))
        raise SageGRPOError(f"the checkpoint is image-to-video but {source} gives no reference image for "
                            f"{missing.prompt[:60]!r}: give every prompt a ref_image_path column (CSV/JSONL, relative "
                            "to the prompt file) or --image, or use a text-to-video checkpoint")


def bucket_size(height: int, width: int, target_size: int, patch: int) -> tuple[int, int]:
    """The (height, width) in pixels of an image's bucket: the bucket list of `target_size` in steps of `patch`
    (the VAE's spatial compression), closest aspect ratio. diffusers' (and the authors') rule, via their function."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    proc = HunyuanVideo15ImageProcessor(vae_scale_factor=patch)
    h, w = proc.calculate_default_height_width(height=height, width=width, target_size=target_size)
    return int(h), int(w)


# ------------------------------------------------------------------------------------------------ encoding


@torch.no_grad()
def encode_reference(pipe, image, device: torch.device | str, dtype: torch.dtype) -> ImageConditioning:
    """One PIL image -> its ImageConditioning [1, ...] on CPU in `dtype` (the bucket from the image's own size).

    pipe: an I2V pipeline from sage_grpo.models.loading.load_pipeline (its VAE, image encoder, processors and the
    transformer config's target_size)."""
    vae, enc = pipe.vae, pipe.image_encoder
    if enc is None:
        raise SageGRPOError("a reference image is not in the image cache and the image encoder was not loaded")
    h, w = bucket_size(image.size[1], image.size[0], pipe.transformer.config.target_size,
                       vae.config.spatial_compression_ratio)
    crop = pipe.video_processor.resize(image, height=h, width=w, resize_mode="crop")  # cover, then centre crop
    pixels = pipe.video_processor.preprocess(crop, height=h, width=w)  # [1, 3, h, w] in [-1, 1]
    pixels = pixels.to(device, vae.dtype).unsqueeze(2)  # [1, 3, 1, h, w]: a one-frame video
    latent = vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor  # [1, C, 1, h/s, w/s]
    # SigLIP resizes the crop to its own square input (the pipeline's do_resize=True)
    sig = pipe.feature_extractor.preprocess(images=crop, do_resize=True, return_tensors="pt", do_convert_rgb=True)
    embeds = enc(pixel_values=sig["pixel_values"].to(device, next(enc.parameters()).dtype)).last_hidden_state
    return ImageConditioning(latent, embeds).to("cpu", dtype)  # embeds [1, T_img, D_img]


class ImageConditioningCache:
    """image path -> its ImageConditioning, encoded once per distinct image and kept on CPU in `dtype`.

    Keys are the paths as given (prompt files resolve theirs to absolute paths). Every rank encodes the images it is
    asked for (SigLIP and one VAE encode per image: small next to a rollout). ~1.7 MB per image at the real size
    (729 x 1152 bf16 + a 32 x 30 x 53 latent)."""

    def __init__(self, pipe, device: torch.device | str, dtype: torch.dtype):
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self._memory: dict[str, ImageConditioning] = {}
        self._offloaded = False
        self.num_encoded = 0

    def _entry(self, path: str) -> ImageConditioning:
        e = self._memory.get(path)
        if e is None:
            enc = self.pipe.image_encoder
            if self._offloaded and enc is not None:
                enc.to(self.device)
            try:
                e = encode_reference(self.pipe, open_reference_image(path), self.device, self.dtype)
            finally:
                if self._offloaded and enc is not None:
                    enc.to("cpu")
            self._memory[path] = e
            self.num_encoded += 1
        return e

    def precompute(self, paths: list[str]) -> None:
        for p in dict.fromkeys(paths):
            self._entry(p)

    def latent_hw(self, path: str) -> tuple[int, int]:
        """The latent (height, width) of an image's bucket."""
        return self._entry(path).latent_hw

    def get(self, paths: list[str], device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> ImageConditioning:
        """N paths -> [N, ...] on `device` (default: the cache device) in `dtype` (default: the cache dtype)."""
        return ImageConditioning.cat([self._entry(p) for p in paths]).to(device or self.device, dtype or self.dtype)

    def offload_encoder(self) -> None:
        """Move the image encoder to CPU (it comes back only for an image that is not cached)."""
        if self.pipe.image_encoder is not None:
            self.pipe.image_encoder.to("cpu")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._offloaded = True

    def __len__(self) -> int:
        return len(self._memory)
