"""Pretraining of the tiny world model: a HunyuanVideo-1.5 (the same diffusers classes, the project's text path)
that draws the synthetic world, trained on 2 CPU cores.

Three stages, each seeded:
1. clips: `num_clips` training clips of the world (`sage_grpo.world.sample_clip`, 9 frames of 32 x 32 px);
2. the VAE (`AutoencoderKLHunyuanVideo15`, 4x spatial / 4x temporal, 8 latent channels) as an autoencoder on
   them: L1 + MSE of the reconstruction from a posterior sample, plus a small KL; its `scaling_factor` is set to
   1 / std of the posterior means, as for the real VAE, so the diffusion latents have unit scale;
3. the transformer (`HunyuanVideo15Transformer3DModel`, 4 double-stream blocks of width 64) by the flow-matching
   objective HunyuanVideo-1.5 trains with: x_s = (1 - s) x_0 + s eps, target velocity eps - x_0, s drawn as the
   shifted uniform of the sampler's schedule (shift 5, so training sees the noise levels sampling visits), the
   caption replaced by the negative prompt ("") 10% of the time so classifier-free guidance works. Its forward is
   `sage_grpo.rollout.predict_velocity`, the one the rollout and the GRPO update call. Weights are averaged (EMA).

The text encoders are the tiny random ones of `sage_grpo.models.tiny`, frozen; the Qwen tokenizer gets BPE merges
for the world's words (the real Qwen tokenizer has a token per common English word; byte-level tokens would make
the tiny transformer spend its budget learning to spell). `save_world_model` writes the diffusers layout, which
`sage_grpo.models.loading.load_pipeline` reads like real weights; the transformer is stored in bf16 (as the real
HunyuanVideo-1.5 weights are), which keeps the committed model under 25 MB.

Deterministic for a seed and a thread count (CPU float sums depend on how the work is split across threads).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sage_grpo.world.captions import make_caption
from sage_grpo.world.render import DEFAULT_FRAMES, DEFAULT_SIZE
from sage_grpo.world.sampler import sample_clip, single_object_attributes

__all__ = [
    "WORLD_MODEL_DIR",
    "WORLD_I2V_MODEL_DIR",
    "WORLD_GUIDANCE_SCALE",
    "i2v_model_dir",
    "encode_first_frames",
    "object_cells",
    "PretrainSettings",
    "world_tokenizer",
    "world_transformer_config",
    "world_vae_config",
    "build_world_components",
    "batched_vae_attention",
    "render_clips",
    "train_vae",
    "encode_latents",
    "train_transformer",
    "save_world_model",
    "pretrain",
]

# Query and key bias of the world text encoder's attention (see build_world_components).
LOCAL_QK = 2.0
# The committed pretrained models (diffusers layout), relative to the repository root. `pretrain` writes a
# text-to-video checkpoint and, beside it, the image-to-video one (the same transformer and VAE files plus the tiny
# SigLIP). Committed: both checkpoints of this module's defaults, from one run (git stores the shared files once).
WORLD_MODEL_DIR = "assets/tiny_world/hunyuanvideo15"
WORLD_I2V_MODEL_DIR = "assets/tiny_world/hunyuanvideo15_i2v"
# The CFG scale the world model is sampled with (scripts/eval_tiny.py, the configs/tiny_world*.yaml that use CFG),
# saved as the checkpoints' guider config: their own default, so a run at the configs' scale warns about nothing.
WORLD_GUIDANCE_SCALE = 4.0



@dataclass(frozen=True)
class PretrainSettings:
    """Everything that decides the pretrained weights (saved beside them as pretrain_settings.json)."""

    seed: int = 0
    latent_channels: int = 16  # 4x4 pixels x 4 frames x RGB (192 values) -> 16 per latent cell
    num_clips: int = 2000  # training clips, rendered once
    two_object_prob: float = 0.25
    vae_steps: int = 1500
    vae_batch: int = 8
    vae_lr: float = 1.5e-3
    vae_kl_weight: float = 1e-6
    vae_crop: int = 16  # > 0: the first 80% of VAE steps train on random crops of this many pixels (0 = whole frames)
    vae_object_weight: float = 10.0  # extra loss weight of pixels off the background (objects are ~3-10% of a frame)
    transformer_steps: int = 6000
    transformer_batch: int = 32
    transformer_lr: float = 2e-3
    warmup_steps: int = 50
    caption_dropout: float = 0.1
    shift: float = 5.0  # flow shift of the sampler schedule (configs sample with the same)
    ema_decay: float = 0.995
    object_weight: float = 4.0  # extra flow-matching loss weight of latent cells an object touches (0: plain MSE)
    i2v_prob: float = 0.3  # share of transformer batches conditioned on their first frame (0: text-to-video only)
    threads: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


def world_words() -> list[str]:
    """The words of every one-object caption plus the two-object "and" and "move", in a fixed order. (The
    two-object "bounce" needs no entry: it is a prefix of "bounces", so its merge chain makes it a token too.)"""
    words: set[str] = set()
    for split in ("train", "heldout"):
        for attrs in single_object_attributes(split):
            words.update(make_caption(attrs).split())
    words.update(("and", "move"))  # two-object captions: "a ... and a ... move right on ..."
    return sorted(words)


def world_tokenizer():
    """The tiny byte-level Qwen2 tokenizer plus BPE merges that make each world word (with its leading space, "Ġ"
    in byte-level BPE) one token. Merges grow every word from the left and are ranked by length, so no merge can
    split another word's chain."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    from sage_grpo.models.tiny import QWEN_CHAT_TEMPLATE

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    by_length: dict[int, list[tuple[str, str]]] = {}
    for w in world_words():
        s = "Ġ" + w
        for k in range(2, len(s) + 1):
            by_length.setdefault(k, []).append((s[: k - 1], s[k - 1]))
    merges = list(dict.fromkeys(pair for k in sorted(by_length) for pair in by_length[k]))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.padding_side = "right"
    return tok


def world_transformer_config(latent_channels: int) -> dict:
    """target_size 32: the bucket base of the world's 32 x 32 frames, so a world frame given as the reference image
    of the I2V checkpoint keeps its size (the real checkpoints: 640 for 480p)."""
    from sage_grpo.models.tiny import TINY_BYT5_DIM, TINY_IMAGE_DIM, TINY_TEXT_DIM, tiny_transformer_config

    return {**tiny_transformer_config(), "in_channels": 2 * latent_channels + 1, "out_channels": latent_channels,
            "num_layers": 4, "mlp_ratio": 4.0, "text_embed_dim": TINY_TEXT_DIM, "text_embed_2_dim": TINY_BYT5_DIM,
            "image_embed_dim": TINY_IMAGE_DIM, "target_size": DEFAULT_SIZE}


def world_vae_config(latent_channels: int) -> dict:
    from sage_grpo.models.tiny import tiny_vae_config

    return {**tiny_vae_config(), "latent_channels": latent_channels, "block_out_channels": (16, 32, 64),
            "scaling_factor": 1.0}  # set from the data by train_vae


def build_world_components(seed: int, latent_channels: int = 16, i2v: bool = False) -> dict:
    """Untrained world-model components (diffusers' initialisation), keyed like HunyuanVideo15Pipeline's modules;
    i2v adds the tiny frozen SigLIP (`image_encoder`, `feature_extractor`) of HunyuanVideo15ImageToVideoPipeline.
    The SigLIP is drawn after the transformer and VAE (their weights do not depend on i2v) but before the text
    encoder's re-initialisation below, so the world text encoder does: each checkpoint saves the text encoder its
    transformer learnt with."""
    from diffusers import ClassifierFreeGuidance

    from sage_grpo.models.tiny import build_tiny_components

    comps = build_tiny_components(seed, tokenizer=world_tokenizer(),
                                  transformer_config=world_transformer_config(latent_channels),
                                  vae_config=world_vae_config(latent_channels), perturb=False,
                                  task="i2v" if i2v else "t2v")
    comps["guider"] = ClassifierFreeGuidance(guidance_scale=WORLD_GUIDANCE_SCALE)
    # The frozen text encoder. Text tokens get no position in HunyuanVideo-1.5: word order ("a red circle on a blue
    # background" vs "a blue circle on a red background") reaches the transformer only through the encoder's
    # context, which a pretrained Qwen provides and a random one does not (its attention spreads over the ~100
    # template tokens, so a word's features hardly depend on its neighbours). So: unit scale (embeddings N(0, 1),
    # matrices N(0, 1 / fan_in); at transformers' 0.02 the features are 50x smaller than the video tokens) and
    # queries and keys that are a constant vector (zero weights, bias LOCAL_QK), so attention logits depend only on
    # the rotary distance: each token attends mostly to itself and the word before it (weights ~1 : 0.37 : 0.04).
    with torch.no_grad():
        for name, p in comps["text_encoder"].named_parameters():
            if "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.zero_()
            elif name.endswith(("q_proj.bias", "k_proj.bias")):
                p.fill_(LOCAL_QK)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return comps


@contextlib.contextmanager
def batched_vae_attention() -> Iterator[None]:
    """diffusers 0.42.1's HunyuanVideo-1.5 VAE attention builds its causal mask as [B, S, S], which scaled-dot-product
    attention broadcasts against [B, 1, S, C] as if B were heads: batches > 1 fail (that is why
    sage_grpo.rollout.decode_latents decodes one sample at a time). Training needs batches, so while this context is
    open the mask is [B, 1, S, S] (same values, built without the per-token Python loop)."""
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as vae_module

    block = vae_module.HunyuanVideo15AttnBlock
    original = block.__dict__["prepare_causal_attention_mask"]

    def causal_mask(n_frame: int, n_hw: int, dtype, device, batch_size: int | None = None) -> torch.Tensor:
        frame = torch.arange(n_frame * n_hw, device=device) // n_hw  # [S] latent frame of each token
        mask = torch.zeros(frame.numel(), frame.numel(), dtype=dtype, device=device)
        mask = mask.masked_fill(frame[None, :] > frame[:, None], float("-inf"))  # a token sees frames <= its own
        return mask if batch_size is None else mask[None, None].expand(batch_size, 1, -1, -1)

    block.prepare_causal_attention_mask = staticmethod(causal_mask)
    try:
        yield
    finally:
        block.prepare_causal_attention_mask = original


def render_clips(s: PretrainSettings) -> tuple[torch.Tensor, list[str]]:
    """-> videos uint8 [N, F, 3, H, W] (uint8 keeps 2000 clips at 55 MB) and their captions."""
    videos, captions = [], []
    for i in range(s.num_clips):
        clip = sample_clip(s.seed, i, "train", DEFAULT_SIZE, DEFAULT_FRAMES, s.two_object_prob)
        videos.append((clip.video * 255).round().to(torch.uint8))
        captions.append(clip.caption)
    return torch.stack(videos), captions


def _to_vae(videos_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [B, F, 3, H, W] -> the VAE's input [B, 3, F, H, W] in [-1, 1]."""
    return (videos_u8.float() / 127.5 - 1.0).permute(0, 2, 1, 3, 4)


def _off_background(clips_u8: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B, 1, F, h, w] 1.0 where the pixels of `x` (VAE input, [-1, 1]) are not the background colour of their clip
    (the median colour of its whole first frame: the background covers most of every frame)."""
    bg = _to_vae(clips_u8[:, :1]).flatten(2).median(dim=2).values  # [B, 3]
    return ((x - bg[:, :, None, None, None]).abs().amax(dim=1, keepdim=True) > 0.2).float()


def object_cells(videos_u8: torch.Tensor, vae_config) -> torch.Tensor:
    """[N, 1, F', H', W'] 1.0 at the latent cells whose pixels show an object in any of their frames (the causal
    VAE's cells: latent frame 0 is frame 0, each later one a group of `temporal_compression_ratio` frames; a cell
    covers `spatial_compression_ratio` pixels a side), 0.0 on plain background."""
    t, sp = vae_config.temporal_compression_ratio, vae_config.spatial_compression_ratio
    mask = _off_background(videos_u8, _to_vae(videos_u8))  # [N, 1, F, H, W]
    first, rest = mask[:, :, :1], mask[:, :, 1:]
    rest = rest.unflatten(2, (rest.shape[2] // t, t)).amax(dim=3)  # [N, 1, (F - 1) / t, H, W]
    return F.max_pool3d(torch.cat([first, rest], dim=2), (1, sp, sp))  # [N, 1, F', H', W']


def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_vae(vae, videos_u8: torch.Tensor, s: PretrainSettings,
              log: Callable[[str], None] = print) -> dict[str, float]:
    """Train `vae` in place on the clips; sets its scaling_factor. -> final losses.

    The first 80% of steps see 5-frame windows (one lone frame + one 4-frame group: everything the causal VAE
    does, at 5/9 of the cost), cropped to `vae_crop` pixels when set (the VAE is convolutional apart from its
    mid-block attention, so crops teach the same filters at a fraction of the cost per step);
    the rest whole 9-frame clips, as sampling decodes them.
    """
    g = torch.Generator().manual_seed(s.seed + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=s.vae_lr, weight_decay=0.0)
    vae.train()
    n, frames, size = videos_u8.shape[0], videos_u8.shape[1], videos_u8.shape[-1]
    stats: dict[str, float] = {}
    with batched_vae_attention():
        for step in range(s.vae_steps):
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, s.vae_steps, s.vae_lr, s.warmup_steps)
            early = step < int(0.8 * s.vae_steps)
            crop = s.vae_crop if early and 0 < s.vae_crop < size else size
            idx = torch.randint(n, (s.vae_batch,), generator=g)
            window = 5 if early else frames
            start = int(torch.randint(frames - window + 1, (1,), generator=g))
            y0, x0 = (int(v) for v in torch.randint(size - crop + 1, (2,), generator=g)) if crop < size else (0, 0)
            x = _to_vae(videos_u8[idx, start : start + window, :, y0 : y0 + crop, x0 : x0 + crop])  # [B, 3, F, h, w]
            weight = 1.0 + s.vae_object_weight * _off_background(videos_u8[idx], x)  # [B, 1, F, h, w]
            post = vae.encode(x).latent_dist
            z = post.mean + post.std * torch.randn(post.mean.shape, generator=g)
            y = vae.decode(z).sample
            err = y - x
            l1, mse = (weight * err.abs()).mean(), (weight * err**2).mean()
            kl = post.kl().mean() / x[0].numel()  # per pixel value, so the weight does not depend on clip size
            loss = l1 + mse + s.vae_kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            stats = {"l1": l1.item(), "mse": mse.item(), "kl": kl.item()}
            if step % 50 == 0 or step == s.vae_steps - 1:
                log(f"vae step {step + 1}/{s.vae_steps}: l1 {stats['l1']:.4f} mse {stats['mse']:.5f}")
    vae.eval()
    return stats


@torch.no_grad()
def encode_latents(vae, videos_u8: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """Posterior means of the clips, scaled: [N, C, F', H', W'] fp32. Sets vae.config.scaling_factor to 1 / their
    std (the diffusion latents are VAE latents x scaling_factor; sage_grpo.rollout.decode_latents divides)."""
    with batched_vae_attention():
        means = torch.cat([vae.encode(_to_vae(videos_u8[i : i + batch])).latent_dist.mean
                           for i in range(0, videos_u8.shape[0], batch)])
    scale = float(1.0 / means.std())
    vae.register_to_config(scaling_factor=scale)
    return means * scale


@torch.no_grad()
def encode_first_frames(pipe, videos_u8: torch.Tensor):
    """The first frame of every clip as an I2V reference image, encoded by the inference path
    (`sage_grpo.models.image_cond.encode_reference`: bucket crop, VAE mode x scaling_factor, SigLIP) ->
    ImageConditioning [N, ...] fp32. Needs the VAE's final scaling_factor (`encode_latents` sets it)."""
    import PIL.Image

    from sage_grpo.models.image_cond import ImageConditioning, encode_reference

    frames = videos_u8[:, 0].permute(0, 2, 3, 1).numpy()  # [N, H, W, 3] uint8
    return ImageConditioning.cat([encode_reference(pipe, PIL.Image.fromarray(f), "cpu", torch.float32)
                                  for f in frames])


def _ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1.0 - decay)


def train_transformer(pipe, latents: torch.Tensor, captions: list[str], s: PretrainSettings,
                      log: Callable[[str], None] = print, state_file: Path | None = None,
                      checkpoint_every: int = 100, images=None,
                      objects: torch.Tensor | None = None) -> tuple[torch.nn.Module, dict[str, float]]:
    """Flow-matching training of pipe.transformer on (latents, captions). -> (EMA transformer, final stats).

    objects: [N, 1, F', H', W'] the clips' `object_cells`; the squared error there weighs 1 + s.object_weight
    instead of 1. The objects cover a few percent of a frame, so under the plain MSE the background dominates and
    the model learns to leave it empty: at 1,000 steps the previous settings (object_weight 0) drew the
    caption's colour in 0.29 of held-out videos, with 4 in 0.95 (docs/world_model.md). Weighting by the clean clip's
    cells also tilts the learnt velocity toward drawing an object where one could be.

    images: ImageConditioning [N, ...] of the clips' first frames (`encode_first_frames`), or None. With images, a
    share `s.i2v_prob` of the batches is image-to-video: every clip of the batch conditioned on its own first frame,
    as the I2V pipeline conditions (condition latent and mask in frame 0, SigLIP embeds; a caption dropped for CFG
    keeps its image, since the negative branch changes only the text); the others text-to-video, so one
    transformer serves both checkpoints (the authors' fine-tuning mixes the tasks the same way, --i2v_prob 0.3).

    state_file: every `checkpoint_every` steps the stage's whole state (weights, EMA, optimizer, the generator, the
    smoothed loss, the step) is written there atomically; a run that finds it (with the same settings) continues
    from its step, to the weights an uninterrupted run reaches (tested bitwise)."""
    from sage_grpo.models.attention import use_valid_token_attention
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.rollout import SamplerSettings, predict_velocity

    g = torch.Generator().manual_seed(s.seed + 2)
    cache = TextEmbeddingCache(pipe, "cpu", torch.float32)
    cache.precompute(sorted(set(captions)) + [""])  # "": the negative prompt the rollout's CFG uses
    transformer = pipe.transformer
    use_valid_token_attention(transformer)
    transformer.train()
    ema = copy.deepcopy(transformer).eval().requires_grad_(False)
    settings = SamplerSettings(sde_type="ode", cfg_scale=1.0, shift=s.shift)
    opt = torch.optim.AdamW(transformer.parameters(), lr=s.transformer_lr, weight_decay=0.01)
    n = latents.shape[0]
    stats: dict[str, float] = {}
    running, first = None, 0
    if state_file is not None and state_file.is_file():
        saved = torch.load(state_file, map_location="cpu", weights_only=True)  # our own file, still no pickles
        if saved["settings"] == json.dumps(s.to_dict(), sort_keys=True):
            transformer.load_state_dict(saved["transformer"])
            ema.load_state_dict(saved["ema"])
            opt.load_state_dict(saved["optimizer"])
            g.set_state(saved["generator"])
            first, running = int(saved["step"]), float(saved["running"])
            log(f"transformer: continuing from step {first} ({state_file})")
        else:
            log(f"transformer: {state_file} was written with other settings; starting over")
    for step in range(first, s.transformer_steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, s.transformer_steps, s.transformer_lr, s.warmup_steps)
        idx = torch.randint(n, (s.transformer_batch,), generator=g)
        i2v = images is not None and float(torch.rand(1, generator=g)) < s.i2v_prob
        x0 = latents[idx]  # [B, C, F, H, W]
        drop = torch.rand(s.transformer_batch, generator=g) < s.caption_dropout
        prompts = ["" if d else captions[int(i)] for i, d in zip(idx, drop)]
        u = torch.rand(s.transformer_batch, generator=g)
        sigma = s.shift * u / (1.0 + (s.shift - 1.0) * u)  # [B] the schedule's shift applied to uniform times
        eps = torch.randn(x0.shape, generator=g)
        sig = sigma.view(-1, 1, 1, 1, 1)
        xt = (1.0 - sig) * x0 + sig * eps
        v = predict_velocity(transformer, xt, sigma, cache.get(prompts), None, settings,
                             image_tokens=pipe.vision_num_semantic_tokens, image=images.index(idx) if i2v else None)
        weight = 1.0 if objects is None else 1.0 + s.object_weight * objects[idx]  # [B, 1, F', H', W']
        loss = (weight * (v - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        _ema_update(ema, transformer, s.ema_decay if step >= s.warmup_steps else 0.0)
        loss_value = loss.item()
        running = loss_value if running is None else 0.98 * running + 0.02 * loss_value
        stats = {"loss": loss_value, "loss_ema": running}
        if step % 50 == 0 or step == s.transformer_steps - 1:
            log(f"transformer step {step + 1}/{s.transformer_steps}: loss {loss_value:.4f} (smoothed {running:.4f})")
        if state_file is not None and (step + 1) % checkpoint_every == 0 and step + 1 < s.transformer_steps:
            _save_atomic({"settings": json.dumps(s.to_dict(), sort_keys=True), "step": step + 1, "running": running,
                          "transformer": transformer.state_dict(), "ema": ema.state_dict(),
                          "optimizer": opt.state_dict(), "generator": g.get_state()}, state_file)
    transformer.eval()
    return ema, stats


def _save_atomic(obj: dict, path: Path) -> None:
    """torch.save to a temporary file, then rename: a kill leaves the previous state or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def save_world_model(comps: dict, out: str | Path, extra: dict | None = None) -> Path:
    """Components -> `out` in the diffusers layout (transformer in bf16) + the text lengths and the settings; an
    image-to-video checkpoint (HunyuanVideo15ImageToVideoPipeline's model_index.json) when they hold an
    image_encoder."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    from sage_grpo.files import usual_permissions
    from sage_grpo.models.tiny import TEXT_LENGTHS_FILE

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    comps = dict(comps)
    lengths = comps.pop("text_lengths")
    comps["transformer"] = comps["transformer"].to(torch.bfloat16)
    cls = HunyuanVideo15ImageToVideoPipeline if comps.get("image_encoder") is not None else HunyuanVideo15Pipeline
    cls(**comps).save_pretrained(out, safe_serialization=True)
    (out / TEXT_LENGTHS_FILE).write_text(json.dumps(lengths.to_dict(), indent=1) + "\n")
    if extra is not None:
        (out / "pretrain_info.json").write_text(json.dumps(extra, indent=1) + "\n")
    return usual_permissions(out)


VAE_FIELDS = ("seed", "latent_channels", "num_clips", "two_object_prob", "vae_steps", "vae_batch", "vae_lr",
              "vae_kl_weight", "vae_crop", "vae_object_weight", "warmup_steps", "threads")


def reusable_vae(s: PretrainSettings, model_dir: str | Path) -> dict:
    """The info of an earlier pretraining in `model_dir` whose VAE stage had the same settings as `s` (the stage is
    deterministic, so its VAE is the one `s` would train); SageGRPOError otherwise."""
    import json

    from sage_grpo.errors import SageGRPOError

    path = Path(model_dir) / "pretrain_info.json"
    if not path.is_file() or not (Path(model_dir) / "vae" / "config.json").is_file():
        raise SageGRPOError(f"--reuse_vae {model_dir}: no pretrain_info.json and vae/ of a pretraining there")
    info = json.loads(path.read_text())
    differ = [k for k in VAE_FIELDS if info["settings"].get(k) != getattr(s, k)]
    if differ:
        raise SageGRPOError(f"--reuse_vae {model_dir}: its VAE was trained with other settings ({', '.join(differ)})")
    return info


def i2v_model_dir(out: str | Path) -> Path:
    """Where `pretrain` writes the image-to-video checkpoint of the model it writes to `out`: beside it, `<out>_i2v`
    (WORLD_I2V_MODEL_DIR for the committed one)."""
    out = Path(out)
    return out.with_name(out.name + "_i2v")


STATE_DIR = "pretrain_state"  # under the output directory while a pretraining runs; removed when it finishes


def pretrain(s: PretrainSettings, out: str | Path, log: Callable[[str], None] = print,
             reuse_vae: str | Path | None = None, checkpoint_every: int = 100) -> dict:
    """The three stages, timed; writes the model to `out`. -> info (settings, seconds and CPU seconds per stage,
    final losses), also saved as out/pretrain_info.json. reuse_vae: a model directory of an earlier pretraining
    with the same VAE settings (`reusable_vae`): its VAE and VAE-stage timings are taken instead of training.

    Resumable: the finished VAE stage is kept in out/pretrain_state/ and the transformer stage writes its state
    there every `checkpoint_every` steps; a run with the same settings that finds them takes the VAE and continues
    the transformer from its last saved step, to the same weights as an uninterrupted run. The state folder is
    removed once the model is written.

    With `s.i2v_prob` > 0 the transformer also learns image-to-video (`train_transformer`), and the same transformer
    and VAE are written a second time with the tiny SigLIP as the image-to-video checkpoint `i2v_model_dir(out)`."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    from sage_grpo.models.loading import apply_text_lengths

    torch.set_num_threads(s.threads)
    info: dict = {"settings": s.to_dict(), "torch": torch.__version__, "stages": {}}
    state = Path(out) / STATE_DIR

    def timed(name: str, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        info["stages"][name] = {"seconds": round(time.perf_counter() - t0, 1),
                                "cpu_seconds": round(time.process_time() - c0, 1)}
        log(f"== {name}: {info['stages'][name]['seconds']} s")
        return result

    i2v = s.i2v_prob > 0
    comps = build_world_components(s.seed, s.latent_channels, i2v=i2v)
    lengths = comps.pop("text_lengths")
    pipe = (HunyuanVideo15ImageToVideoPipeline if i2v else HunyuanVideo15Pipeline)(**comps)
    apply_text_lengths(pipe, lengths)
    videos, captions = timed("render", lambda: render_clips(s))
    cached = state / "vae_stage.json"
    if not reuse_vae and cached.is_file() and json.loads(cached.read_text())["settings"] == s.to_dict():
        reuse_vae = state  # this run's own finished VAE stage, from before an interruption
    if reuse_vae:
        earlier = reusable_vae(s, reuse_vae)
        pipe.vae.load_state_dict(type(pipe.vae).from_pretrained(Path(reuse_vae) / "vae").state_dict())
        info["vae"], info["stages"]["vae"] = earlier["vae"], earlier["stages"]["vae"]
        if Path(reuse_vae) != state:
            info["stages"]["vae"] = {**earlier["stages"]["vae"], "reused_from": str(reuse_vae)}
        log(f"== vae: reused from {reuse_vae} (trained in {earlier['stages']['vae']['seconds']} s)")
    else:
        info["vae"] = timed("vae", lambda: train_vae(pipe.vae, videos, s, log))
        pipe.vae.save_pretrained(state / "vae")
        (state / "pretrain_info.json").write_text(json.dumps(info, indent=1) + "\n")  # what reusable_vae reads
        cached.write_text(json.dumps({"settings": s.to_dict()}) + "\n")  # written last: the stage is complete
    # the clips' latents (which set the VAE's scaling_factor), then their first frames as I2V reference images
    latents, images = timed("encode", lambda: (encode_latents(pipe.vae, videos),
                                               encode_first_frames(pipe, videos) if i2v else None))
    objects = object_cells(videos, pipe.vae.config) if s.object_weight > 0 else None
    pipe.vae.save_pretrained(Path(out) / "vae")  # the finished VAE can be inspected while the transformer trains
    info["scaling_factor"] = pipe.vae.config.scaling_factor
    ema, info["transformer"] = timed("transformer", lambda: train_transformer(
        pipe, latents, captions, s, log, state_file=state / "transformer.pt", checkpoint_every=checkpoint_every,
        images=images, objects=objects))
    info["seconds"] = round(sum(v["seconds"] for v in info["stages"].values()), 1)
    info["cpu_seconds"] = round(sum(v["cpu_seconds"] for v in info["stages"].values()), 1)
    t2v = {k: v for k, v in comps.items() if k not in ("image_encoder", "feature_extractor")}
    save_world_model({**t2v, "transformer": ema, "text_lengths": lengths}, out, info)
    if i2v:
        save_world_model({**comps, "transformer": ema, "text_lengths": lengths}, i2v_model_dir(out), info)
    shutil.rmtree(state, ignore_errors=True)
    return info
