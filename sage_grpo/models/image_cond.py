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
`ImageConditioningCache` (the authors encode it again at every training micro-step) and kept on CPU, or on disk
beside the text embeddings (`--text_embedding_cache_dir`, files `image-<key>.safetensors`, shared by the ranks that
share the directory); the image encoder is offloaded afterwards like the text encoders. A forward holds one task and
one size: the transformer decides T2V vs I2V once per batch (`torch.all(image_embeds == 0)`), and latents of
different sizes do not stack.
"""

from __future__ import annotations

import hashlib
import os
import uuid
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
    "image_encoder_identity",
    "reference_pixels",
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
    """The reference image at `path`, decoded whole, turned upright by its EXIF orientation and converted to RGB
    (PIL.Image), as diffusers' `load_image` does: a phone's portrait JPEG stores landscape pixels and an Orientation
    tag. A missing, unreadable or corrupt file is one SageGRPOError naming it (and `where` it was given: a prompt
    file row, a flag)."""
    import PIL.Image
    import PIL.ImageOps

    path = Path(path)
    at = f" ({where})" if where else ""
    if not path.is_file():
        raise SageGRPOError(f"reference image {path}{at} does not exist" if not path.exists()
                            else f"reference image {path}{at} is not a file")
    try:
        with PIL.Image.open(path) as im:
            im.load()  # decode every pixel now: a truncated file fails here, not in the middle of a run
            return PIL.ImageOps.exif_transpose(im).convert("RGB")
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


def check_task(task: str, records, source: str, image_flag: str = "") -> None:
    """The prompts fit the checkpoint's task: an I2V checkpoint needs a reference image for every prompt, a T2V one
    takes none (it has no image encoder; silently ignoring the images would train text-to-video). source: where the
    prompts come from, for the message (a prompt file, a flag); image_flag: the command's flag that gives an image
    beside a prompt, if it has one (generate.py's --image; post_train.py has none)."""
    with_image = [r for r in records if getattr(r, "ref_image_path", None)]
    if task == "t2v" and with_image:
        raise SageGRPOError(f"{source} gives reference images (ref_image_path, e.g. {with_image[0].ref_image_path}) "
                            "but the checkpoint is text-to-video; use an image-to-video checkpoint (e.g. 480p_i2v) or "
                            "drop the images")
    if task == "i2v" and len(with_image) < len(records):
        missing = next(r for r in records if not getattr(r, "ref_image_path", None))
        raise SageGRPOError(f"the checkpoint is image-to-video but {source} gives no reference image for "
                            f"{missing.prompt[:60]!r}: give every prompt a ref_image_path column (CSV/JSONL, relative "
                            f"to the prompt file){' or ' + image_flag if image_flag else ''}, or use a text-to-video "
                            "checkpoint")


def bucket_size(height: int, width: int, target_size: int, patch: int) -> tuple[int, int]:
    """The (height, width) in pixels of an image's bucket: the bucket list of `target_size` in steps of `patch`
    (the VAE's spatial compression), closest aspect ratio. diffusers' (and the authors') rule, via their function."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    proc = HunyuanVideo15ImageProcessor(vae_scale_factor=patch)
    h, w = proc.calculate_default_height_width(height=height, width=width, target_size=target_size)
    return int(h), int(w)


def reference_pixels(path: str, height: int, width: int) -> Tensor:
    """The reference image as the video's first frame should look: resized to cover height x width and centre
    cropped (the conditioning's crop, at the video's size) -> float32 [3, height, width] in [0, 1]."""
    import numpy as np
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    crop = HunyuanVideo15ImageProcessor(do_resize=False).resize(open_reference_image(path), height=height,
                                                                 width=width, resize_mode="crop")
    return torch.from_numpy(np.asarray(crop, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


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
    # the whole crop in one pass whatever --vae_tiling set for the decode: tiles blended at their overlaps give
    # another latent. diffusers' pipeline encodes with its VAE as loaded (untiled) and the authors' inference tiles
    # only the decode, so the condition is a function of the image and the weights alone, in every entry point.
    tiling, vae.use_tiling = vae.use_tiling, False
    try:
        latent = vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor  # [1, C, 1, h/s, w/s]
    finally:
        vae.use_tiling = tiling
    # SigLIP resizes the crop to its own square input (the pipeline's do_resize=True)
    sig = pipe.feature_extractor.preprocess(images=crop, do_resize=True, return_tensors="pt", do_convert_rgb=True)
    embeds = enc(pixel_values=sig["pixel_values"].to(device, next(enc.parameters()).dtype)).last_hidden_state
    return ImageConditioning(latent, embeds).to("cpu", dtype)  # embeds [1, T_img, D_img]


_IMAGE_DIRS = {  # what an image's conditioning depends on besides the image, per checkpoint layout
    "diffusers": ("vae", "image_encoder", "feature_extractor"),
    "authors": ("vae", "vision_encoder/siglip"),
}


# how encode_reference turns an image into its conditioning: change it when that changes, so that cache files
# written the old way are not read as the new way's
ENCODING = "upright by EXIF; bucket crop; VAE mode of the whole crop, untiled, x scaling_factor; SigLIP last state"


def image_encoder_identity(pipe) -> str:
    """What an image's conditioning depends on besides the image: the VAE and SigLIP files (weights by size + first
    and last MiB, as the text cache's identity), the bucket base target_size, the VAE's dtype and the ENCODING:
    other weights, buckets, VAE dtype or encoding at the same path get another identity. SigLIP computes in the
    pipeline's dtype, the cache's own (ImageConditioningCache.identity adds it). The VAE's tiling is not in it: the
    reference is encoded whole whatever the decode's tiling."""
    from sage_grpo.models.text_cache import _file_digest

    loc = getattr(pipe, "sage_grpo_location", None)
    if loc is None:
        raise ValueError("the image cache needs a pipeline from sage_grpo.models.loading.load_pipeline")
    parts = [loc.layout, f"target_size={pipe.transformer.config.target_size}", ENCODING, f"vae={pipe.vae.dtype}"]
    for sub in _IMAGE_DIRS[loc.layout]:
        d = Path(loc.root) / sub
        files = sorted(f for f in d.rglob("*") if f.is_file()) if d.is_dir() else []
        parts += [f"{f.relative_to(loc.root).as_posix()}:{_file_digest(f)}" for f in files]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def image_digest(path: str | Path) -> str:
    """sha256 of the whole image file. Not the weight files' digest (size + first and last MiB): an uncompressed
    image (BMP, TIFF) over 2 MiB edited in the middle keeps its size and both ends."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class ImageConditioningCache:
    """image path -> its ImageConditioning, encoded once per distinct image, in `dtype`.

    Keys are the paths as given (prompt files resolve theirs to absolute paths). Without `cache_dir` the entries stay
    in CPU memory (~1.7 MB per image at the real size: 729 x 1152 bf16 + a 32 x 30 x 53 latent) and every rank
    encodes the images it is asked for. With `cache_dir` (the text-embedding cache's directory) each image is one
    file `image-<sha256(identity, path, image_digest)>.safetensors`, written atomically and never rewritten, read
    at every `get` (nothing held in memory); an edited image has another digest and is encoded again; an unreadable
    file is a miss. `precompute(paths, info)` under torchrun then splits the distinct images over the ranks."""

    def __init__(self, pipe, device: torch.device | str, dtype: torch.dtype, cache_dir: str | Path | None = None):
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._memory: dict[str, ImageConditioning] = {}
        self._on_disk: set[str] = set()
        self._identity: str | None = None
        self._offloaded = False
        self.num_encoded = 0  # images run through the encoders by this process (tests and logs)

    @property
    def identity(self) -> str:
        if self._identity is None:
            self._identity = image_encoder_identity(self.pipe) + f":{self.dtype}"
        return self._identity

    def _file(self, path: str) -> Path:
        if not Path(path).is_file():
            open_reference_image(path)  # raises the one message for a missing image or a folder
        try:
            digest = image_digest(path)
        except OSError as e:
            raise SageGRPOError(f"reference image {path} cannot be read: {e.strerror or e}") from None
        key = hashlib.sha256(f"{self.identity}\n{path}\n{digest}".encode()).hexdigest()
        return self.cache_dir / f"image-{key}.safetensors"

    def _read(self, file: Path, path: str) -> ImageConditioning | None:
        from sage_grpo.models.text_cache import read_cache_file

        found = read_cache_file(file, {"image": path, "identity": self.identity}, "image", "image")
        return None if found is None else ImageConditioning(found[0]["latents"], found[0]["embeds"])

    def _save(self, file: Path, path: str, e: ImageConditioning) -> None:
        from safetensors.torch import save_file

        from sage_grpo.files import usual_permissions

        if self._read(file, path) is not None:
            return  # another rank or job wrote it meanwhile
        tmp = file.with_name(f"{file.stem}.{os.getpid()}.{uuid.uuid4().hex}.tmp")  # unique per writer
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            save_file({"latents": e.latents.contiguous(), "embeds": e.embeds.contiguous()}, tmp,
                      metadata={"image": path, "identity": self.identity})
            usual_permissions(tmp)
            os.replace(tmp, file)  # atomic: a reader sees no file or a complete one
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise SageGRPOError(f"cannot write the image cache in {self.cache_dir}: {err.strerror or err}") from err

    def _encode(self, path: str) -> ImageConditioning:
        enc = self.pipe.image_encoder
        if self._offloaded and enc is not None:
            enc.to(self.device)
        try:
            e = encode_reference(self.pipe, open_reference_image(path), self.device, self.dtype)
        finally:
            if self._offloaded and enc is not None:
                enc.to("cpu")
        self.num_encoded += 1
        return e

    def _entry(self, path: str) -> ImageConditioning:
        """Memory, then disk, then the encoders (the result goes to disk if there is one, else to memory)."""
        e = self._memory.get(path)
        if e is not None:
            return e
        if self.cache_dir is None:
            e = self._memory[path] = self._encode(path)
            return e
        file = self._file(path)
        e = self._read(file, path)
        if e is None:
            e = self._encode(path)
            self._save(file, path, e)
        self._on_disk.add(path)
        return e

    def precompute(self, paths: list[str], info=None) -> None:
        """Make every image available. `info` (DistInfo) of a multi-rank run with a cache_dir: COLLECTIVE, every
        rank calls it with the same paths; each distinct image is encoded by one rank, the others read its file
        (a directory not shared by every node: a rank encodes what it does not find). Otherwise this process
        resolves every image itself."""
        distinct = list(dict.fromkeys(paths))
        if info is None or not info.distributed or self.cache_dir is None:
            for p in distinct:
                self._entry(p)
            return
        import torch.distributed as dist

        def run_all(fn) -> None:  # every rank raises the first failure of any rank (no rank left waiting)
            try:
                fn()
                err = None
            except Exception as e:  # noqa: BLE001 -- re-raised below, on every rank
                err = f"rank {info.rank}: {e}"
            errors: list = [None] * info.world_size
            dist.all_gather_object(errors, err)
            errors = [x for x in errors if x is not None]
            if errors:
                raise SageGRPOError(f"image encoding failed on {len(errors)} rank(s); {errors[0]}")

        run_all(lambda: [self._entry(p) for p in distinct[info.rank::info.world_size]])
        run_all(lambda: [self._entry(p) for p in distinct])  # reads the others' files (encodes what is missing)

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
        return len(self._memory) + len(self._on_disk)
