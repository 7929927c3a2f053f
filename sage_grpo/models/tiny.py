"""Tiny random HunyuanVideo-1.5 components: the same classes as the real model, configs small enough for CPU tests.

Everything is built in-process (no hub, no files): a byte-level Qwen2 tokenizer (256 byte tokens + the Qwen chat
special tokens, no merges), `ByT5Tokenizer()` (needs no files), a 3-layer Qwen2.5-VL text tower (the pipeline reads
hidden_states[-3]), a 1-layer T5 encoder, a 4x spatial / 4x temporal VAE and a 1-block transformer. The real
pipeline keeps its text lengths (1000 tokens, crop 108, ByT5 256, 729 image tokens) as plain attributes that
`save_pretrained` does not store, so tiny checkpoints write them to `TEXT_LENGTHS_FILE` and the loader applies them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
)

__all__ = [
    "TEXT_LENGTHS_FILE",
    "TextLengths",
    "QWEN_CHAT_TEMPLATE",
    "task_of_version",
    "Variant",
    "VARIANTS",
    "UNSUPPORTED_VARIANTS",
    "variant_of",
    "tiny_variant_config",
    "tiny_transformer_config",
    "tiny_vae_config",
    "build_tiny_image_encoder",
    "build_tiny_tokenizer",
    "build_tiny_components",
    "default_system_message",
    "tiny_crop_start",
]

# Written next to model_index.json (or the authors' root) by scripts/make_tiny_checkpoint.py; absent for real weights.
TEXT_LENGTHS_FILE = "sage_grpo_text_lengths.json"

# Qwen's chat format (what the real Qwen2.5-VL tokenizer's template renders for text-only messages).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TextLengths:
    """Text lengths that HunyuanVideo15Pipeline keeps as attributes (defaults = the real model's)."""

    tokenizer_max_length: int = 1000  # Qwen tokens kept after the crop
    prompt_template_encode_start_idx: int = 108  # system-prompt tokens cropped from the front
    tokenizer_2_max_length: int = 256  # ByT5 glyph tokens
    vision_num_semantic_tokens: int = 729  # SigLIP image tokens (zeros for t2v)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


# Tiny transformer sizes: 2 heads x 32 = 64 wide; rope axes (4, 14, 14) sum to the head dim.
TINY_HEADS, TINY_HEAD_DIM, TINY_LATENT = 2, 32, 4
TINY_TEXT_DIM, TINY_BYT5_DIM, TINY_IMAGE_DIM = 32, 16, 16


# Tiny SigLIP: 28 px images in 14 px patches -> 2 x 2 = 4 tokens (the real so400m: 384 px / 14 -> 27 x 27 = 729).
TINY_SIGLIP_IMAGE, TINY_SIGLIP_PATCH = 28, 14
# Tiny I2V bucket base: the real 480p checkpoints use 640 with the VAE's 16 px patches (40 patches a side); 32 with
# the tiny VAE's 4 px patches keeps a square image at 32 x 32 px -> 8 x 8 latent (64 tokens a frame) for CPU tests.
TINY_I2V_TARGET_SIZE = 32


@dataclass(frozen=True)
class Variant:
    """A HunyuanVideo-1.5 checkpoint's defaults (diffusers' converter TRANSFORMER/SCHEDULER/GUIDANCE_CONFIGS and the
    authors' PIPELINE_CONFIGS; /work/shared/spec/hv15_variants.md section 2)."""

    task: str  # "t2v" | "i2v"
    target_size: int  # bucket base in pixels: 640 (480p), 960 (720p)
    flow_shift: float
    guidance_scale: float  # 1 = CFG-distilled: one forward, no negative branch (there is no guidance embedding)
    steps: int  # recommended sampling steps
    use_meanflow: bool = False  # step-distilled: timestep_r = the next timestep


# Every version name of the authors' layout (transformer/<name>) that diffusers can run; the diffusers repositories
# are hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-<name>.
VARIANTS = {
    "480p_t2v": Variant("t2v", 640, 5.0, 6.0, 50),
    "480p_i2v": Variant("i2v", 640, 5.0, 6.0, 50),
    "720p_t2v": Variant("t2v", 960, 9.0, 6.0, 50),
    "720p_i2v": Variant("i2v", 960, 7.0, 6.0, 50),
    "480p_t2v_distilled": Variant("t2v", 640, 5.0, 1.0, 50),
    "480p_i2v_distilled": Variant("i2v", 640, 5.0, 1.0, 50),
    "720p_t2v_distilled": Variant("t2v", 960, 9.0, 1.0, 50),
    "720p_i2v_distilled": Variant("i2v", 960, 7.0, 1.0, 50),
    "480p_i2v_step_distilled": Variant("i2v", 640, 7.0, 1.0, 12, use_meanflow=True),
}
# Checkpoints of the authors' release that diffusers cannot run, and why.
UNSUPPORTED_VARIANTS = {
    "720p_i2v_distilled_sparse": "sparse attention (SSTA, flex-block-attn) exists only in the authors' code, not in "
                                 "diffusers; use the dense 720p_i2v_distilled",
    "720p_t2v_distilled_sparse": "sparse attention (SSTA) exists only in the authors' code, not in diffusers",
    "720p_sr_distilled": "a super-resolution model (with upsampler/), not a text/image-to-video one; not in diffusers",
    "1080p_sr_distilled": "a super-resolution model (with upsampler/), not a text/image-to-video one; not in diffusers",
}


def variant_of(version: str) -> Variant:
    """The defaults of a version name; an unsupported or unknown name is one SageGRPOError naming the valid ones."""
    from sage_grpo.errors import SageGRPOError

    if version in VARIANTS:
        return VARIANTS[version]
    if version in UNSUPPORTED_VARIANTS:
        raise SageGRPOError(f"HunyuanVideo-1.5 {version} is not supported: {UNSUPPORTED_VARIANTS[version]}")
    raise SageGRPOError(f"unknown HunyuanVideo-1.5 version {version!r}; valid: {', '.join(VARIANTS)}")


def task_of_version(version: str) -> str:
    """"i2v" or "t2v" from an authors' version name (480p_i2v, 720p_i2v_distilled, 480p_i2v_step_distilled, ...)."""
    return "i2v" if "i2v" in version else "t2v"


def tiny_transformer_config(task: str = "t2v") -> dict:
    """The tiny transformer; task "i2v" differs from "t2v" as the real 480p_i2v config differs from 480p_t2v: only
    in task_type (metadata: forward never reads it) and, here, the bucket base target_size."""
    if task not in ("t2v", "i2v"):
        raise ValueError(f"task must be 't2v' or 'i2v', got {task!r}")
    return dict(
        in_channels=2 * TINY_LATENT + 1,  # latent + condition latent + mask (zeros for t2v)
        out_channels=TINY_LATENT,
        num_attention_heads=TINY_HEADS,
        attention_head_dim=TINY_HEAD_DIM,
        num_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=TINY_TEXT_DIM,
        text_embed_2_dim=TINY_BYT5_DIM,
        image_embed_dim=TINY_IMAGE_DIM,
        rope_theta=256.0,
        rope_axes_dim=(4, 14, 14),
        target_size=64 if task == "t2v" else TINY_I2V_TARGET_SIZE,
        task_type=task,
        use_meanflow=False,
    )


def tiny_variant_config(version: str) -> dict:
    """The tiny transformer of a version: I2V or T2V, the bucket base scaled like the real ones (720p = 1.5 x 480p)
    and use_meanflow for the step-distilled model."""
    v = variant_of(version)
    cfg = tiny_transformer_config(v.task)
    cfg["target_size"] = cfg["target_size"] * v.target_size // 640
    cfg["use_meanflow"] = v.use_meanflow
    return cfg


def tiny_vae_config() -> dict:
    # 3 levels -> 4x spatial; temporal ratio 4 like the real VAE (9 frames -> 3 latent frames).
    return dict(
        in_channels=3,
        out_channels=3,
        latent_channels=TINY_LATENT,
        block_out_channels=(16, 32, 32),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
        downsample_match_channel=True,
        upsample_match_channel=True,
        scaling_factor=1.03682,
    )


def build_tiny_tokenizer() -> Qwen2Tokenizer:
    """Byte-level Qwen2 tokenizer: 256 byte tokens, no merges, Qwen's chat special tokens and template."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())  # transformers 5 dropped bytes_to_unicode; this is the same map
    tok = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.padding_side = "right"
    return tok


def tiny_crop_start(tokenizer, system_message: str) -> int:
    """Number of template tokens before the user's text (the real model's 108), measured on `tokenizer`."""
    ids = tokenizer.apply_chat_template(
        [[{"role": "system", "content": system_message}, {"role": "user", "content": "\x01"}]],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"][0]
    marker = tokenizer("\x01", add_special_tokens=False)["input_ids"][0]
    return ids.index(marker)


def build_tiny_image_encoder():
    """A tiny random SiglipVisionModel (width TINY_IMAGE_DIM, 4 tokens) and its SiglipImageProcessor (resize to
    28 x 28, SigLIP's 0.5 mean/std normalisation: the processor's defaults), as the I2V pipeline takes them."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=TINY_IMAGE_DIM, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=TINY_SIGLIP_IMAGE, patch_size=TINY_SIGLIP_PATCH,
    )).eval()
    processor = SiglipImageProcessor(size={"height": TINY_SIGLIP_IMAGE, "width": TINY_SIGLIP_IMAGE})
    return encoder, processor


def build_tiny_components(seed: int = 0, *, tokenizer: Qwen2Tokenizer | None = None,
                          transformer_config: dict | None = None, vae_config: dict | None = None,
                          perturb: bool = True, task: str = "t2v") -> dict:
    """Random tiny components keyed like HunyuanVideo15Pipeline's modules (plus `text_lengths`); task "i2v" adds
    `image_encoder` and `feature_extractor` (HunyuanVideo15ImageToVideoPipeline's modules) and configures the
    transformer for I2V. The T2V weights of a seed do not depend on the task argument's existence: the image encoder
    is drawn last.

    tokenizer / transformer_config / vae_config replace the defaults (the pretrained world model,
    sage_grpo.world.pretrain, uses a tokenizer with word merges and a deeper transformer). perturb=False keeps
    diffusers' initialisation (for training); the default perturbs every weight, see below.
    """
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=TINY_TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=3,  # embeddings come from hidden_states[-3]
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        )
    ).eval()
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=TINY_BYT5_DIM,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
    ).eval()
    transformer = HunyuanVideo15Transformer3DModel(**(transformer_config or tiny_transformer_config(task))).eval()
    vae = AutoencoderKLHunyuanVideo15(**(vae_config or tiny_vae_config())).eval()
    # The transformer and VAE initialise some layers to zero (e.g. proj_out): perturb every parameter so that the
    # tiny model's output depends on all of its weights and the parity tests can fail.
    if perturb:
        with torch.no_grad():
            for module in (transformer, vae):
                for p in module.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
    lengths = TextLengths(
        tokenizer_max_length=64,
        prompt_template_encode_start_idx=tiny_crop_start(tokenizer, default_system_message()),
        tokenizer_2_max_length=16,
        vision_num_semantic_tokens=4,
    )
    extra = {}
    if task == "i2v":
        image_encoder, feature_extractor = build_tiny_image_encoder()
        if perturb:
            with torch.no_grad():
                for p in image_encoder.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
        extra = dict(image_encoder=image_encoder, feature_extractor=feature_extractor)
    return dict(
        **extra,
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
        text_lengths=lengths,
    )


def default_system_message() -> str:
    """The pipeline's system prompt (the default of its static `_get_mllm_prompt_embeds`, same text as `__init__`)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
