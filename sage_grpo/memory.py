"""The per-GPU memory model of a post_train.py run with the real HunyuanVideo-1.5, computed without weights or a GPU:
`plan(cfg, PlanOptions(...))`, what would make a plan fit (`fitting_changes`) and the check post_train.py's preflight
runs on a CUDA device before any model loads (`check_device_memory`). `scripts/plan_memory.py` is its command line
(the same `--config` and flags as post_train.py, plus the planner's own; docs/performance.md "Memory planning").

Where each number comes from
----------------------------
- Parameters: exact. The transformer is built on the meta device from its per-version config
  (`sage_grpo.models.full_size.real_configs`: diffusers' default config, as its converter's TRANSFORMER_CONFIGS);
  LoRA adapters are added by the project's own `setup_trainable` on that meta model; the Muon / AdamW split is the
  project's `goes_to_muon`. The VAE is `AutoencoderKLHunyuanVideo15()` (the converter's default config). The text
  encoders (Qwen2.5-VL-7B-Instruct text tower, google/byt5-small encoder without the Glyph colour/font tokens, a few
  MB) and SigLIP come from the same `real_configs`; the reward model is built on meta from the public config.json
  values copied below (Qwen2-VL-2B-Instruct with the VideoReward vocabulary of 151,660 and its rm_head).
- Transformer activations: an analytic count of the tensors one dual-stream block saves for backward (listed in
  `block_activation_bytes`), checked against `torch.autograd.graph.saved_tensors_hooks` bytes on CPU at reduced
  width (tests/test_plan_memory.py) and against the H100 per-block measurements in ../shared/spec/gpu_facts.md
  (`--validate` prints both). The project runs the valid-token attention processor (sage_grpo/models/attention.py:
  no dense mask, encoder tokens cut to the batch's longest valid prompt), so `--text_tokens` (valid MLLM + ByT5
  tokens, default 256) sets the text length; `--attention diffusers` models diffusers' dense-mask processor (all
  1,985 encoder tokens, a [B, 1, S, S] mask per block), which is what gpu_facts.md measured.
- VAE decode: scaled by video volume from the one H100 measurement (352x624x81: 30.0 GiB untiled, 9.0 GiB tiled).
  post_train.py tiles the decode unless `--vae_tiling False` (the config flag; the planner follows it).
- The no-grad forward's and the checkpointed backward's working sets: fractions of one block's saved activations,
  fitted to one H200's peaks at the real size (BACKWARD_BLOCKS, NO_GRAD_BLOCKS).
- The FP8 base (--fp8_base, sage_grpo/models/fp8.py): the blocks' linear weights in one byte per element plus an
  fp32 scale per output row, in the weights, the shards, the gathered blocks and the all-gather traffic; while a
  layer runs (its forward, and its backward's input gradient) its weight dequantized, one layer at a time, as
  torchao allocates it (an fp32 copy, the fp32 product, the cast: `fp8_dequantize_bytes`, measured on the CPU). The
  layer dequantizes again in its backward and holds no dequantized copy from its forward, so none is planned.
- Reward forward, text-encoder forward, CUDA context: estimates, marked `est` in the table; not measured on a GPU.

Sharding model (FSDP2, sage_grpo/models/parallelize.py): parameters, gradients, optimizer state and the full-fine-tuning
anchor are sharded over dp_shard * sp ranks (HSDP replicates that over dp_replicate). A forward holds two unsharded
blocks (current + prefetch) and the root unit (embedders, refiner, output layer) in `--fsdp_param_dtype`
(MixedPrecisionPolicy(param_dtype=--dtype, reduce_dtype=fp32)), the backward one block's unsharded fp32 gradient.
Without FSDP every rank holds everything, and bf16 autocast over fp32 master weights caches a bf16 copy of every
trainable weight for the duration of a forward (--enable_fsdp False, or one process).
Ulysses sequence parallelism splits the video tokens over sp ranks; the text tokens are replicated on every sp rank
except inside attention (after the all-to-all each rank holds all tokens for heads / sp).

Host memory per rank, text-embedding cache (sage_grpo/models/text_cache.py): each prompt keeps its valid tokens only,
valid MLLM tokens x 3,584 (Qwen2.5-VL-7B hidden size) + quoted-text bytes x 1,472 (ByT5) in --dtype. Assumed typical
prompt (`--prompt_tokens 120 --glyph_tokens 0`): ~90 English words at ~1.3 Qwen tokens per word, including the
closing chat-template tokens left after the system-prompt crop, and no quoted text. Without
--text_embedding_cache_dir every rank holds every prompt; with one a rank holds none (each batch is read from the
files, which the node's page cache shares). Each rank encodes ceil(prompts / world) of them.

Image-to-video (a version whose name holds i2v; every version of sage_grpo.models.tiny.VARIANTS is planned, with
the one architecture): the 729 SigLIP tokens are valid encoder tokens in every block (T2V's are masked zeros, cut by
the valid-token processor); SigLIP (so400m vision tower, public config) is on the GPU while the reference images are
encoded at setup and offloaded with the text encoders (--offload_text_encoder); each video of the trajectory carries
its image's conditioning (729 x 1152 tokens + the frame-0 latent, in --dtype); the host image cache holds that per
image without a cache directory. The video size is --height/--width: set it to the images' bucket (480p 16:9:
480x848; 720p: 720x1280).

Traffic (`step_traffic`, an estimate): bytes each rank moves per step in the FSDP2 parameter all-gathers (rollout,
update forward + backward, anchor), the gradient reduce-scatter and HSDP all-reduce of every backward and
ShardedMuon's exchange, from bandwidth-optimal volumes ((n-1)/n x D per all-gather, 2 (n-1)/n x D per all-reduce);
a group crosses nodes (InfiniBand) when it holds more ranks than `--gpus_per_node`. With FSDP2 under torchrun the
plan also compares the layouts of the same run: full shard over every rank or HSDP with one node per shard group,
each with the rollout re-gathering per forward or kept gathered (`--rollout_reshard_after_forward`).

Phases (peak = the largest): encode (text encoders resident), rollout (no-grad forwards), decode + reward, anchor
(no-grad forwards of the anchor: offloaded under FSDP2 only its gathered blocks come to the GPU; without FSDP the
whole anchor does), update (forward + backward of one micro-batch) and the optimizer step (ShardedMuon's gathers).
Gradients are resident from the update to the optimizer step, and across rounds with gradient accumulation > 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sage_grpo.config import FIELDS, Config, dp_degree, torch_dtype, validate
from sage_grpo.errors import SageGRPOError
from sage_grpo.models.full_size import real_configs

GIB = 2**30

# The real configs live in sage_grpo.models.full_size (diffusers' default transformer = the 480p model; a version
# changes only target_size, task_type and use_meanflow), so every version sage_grpo.models.tiny.VARIANTS knows is
# planned. Each is built on the meta device when first asked for (about a second each), not at import: post_train's
# preflight plans one version, and importing this module costs nothing. SigLIP (I2V): loaded for the image encoding
# at setup, offloaded with the text encoders.
def planned_versions() -> list[str]:
    """The --pretrained_transformer_version names the planner has a transformer config for."""
    from sage_grpo.models.tiny import VARIANTS

    return list(VARIANTS)


@functools.cache
def _transformer_config(version: str) -> dict:
    from sage_grpo.models.full_size import real_transformer_config

    return real_transformer_config(version)


def transformer_config(version: str) -> dict | None:
    """The real transformer config of `version` (a copy), None for a version the planner does not know."""
    return dict(_transformer_config(version)) if version in planned_versions() else None


def __getattr__(name: str):
    """TRANSFORMER_CONFIGS ({version: config} of every planned version), built when first read."""
    if name == "TRANSFORMER_CONFIGS":
        return {v: transformer_config(v) for v in planned_versions()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_REAL = real_configs("480p_i2v")
SIGLIP_SO400M = _REAL["image_encoder"]
QWEN25_VL_7B_TEXT = _REAL["text_encoder"]
BYT5_SMALL = _REAL["text_encoder_2"]
# ... Qwen/Qwen2-VL-2B-Instruct, vocabulary resized to VideoReward's 151,660 tokens, plus rm_head (1536 -> 3).
QWEN2_VL_2B_TEXT = dict(vocab_size=151660, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
QWEN2_VL_2B_VISION = dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, in_chans=3,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
TEXT_LEN_MLLM, TEXT_LEN_BYT5, IMAGE_TOKENS = 1000, 256, 729  # the pipeline's text lengths (reference_system.md)

# H100 measurements (../shared/spec/gpu_facts.md), bf16, random weights.
GPU_FACTS = {
    "block_act_gib": {(1, False): 2.86, (1, True): 0.28, (2, False): 5.93, (2, True): 0.28},  # diffusers processor
    "block_geometry": dict(video_tokens=18018, text_tokens=1985, dim=2048, heads=16, mlp_dim=8192),
    "vae_decode_gib": {False: 30.0, True: 9.0},  # one 352x624x81 latent
    "vae_decode_pixels": 81 * 352 * 624,
}
# Working sets in units of one block's saved activations with grad ("activations: one block, full"), fitted on an
# H200 (scripts/gpu_check.py --stage lora,full --steps 1: 480p_t2v at 81x352x624, CFG 6, valid-token attention;
# 54 blocks LoRA on bf16, 45 blocks full fine-tuning on fp32 master weights under bf16 autocast).
# - The update's recompute and backward of one checkpointed block: 1.14 measured under LoRA. Under full fine-tuning
#   the peak implies 0.47: either its other update terms are planned about 3 GiB high or its backward holds less.
# - A no-grad forward's transient tensors (rollout, anchor): 0.55 (LoRA) and 0.53 (full).
# Both are rounded up here: the plans land +0.3 % to +2.4 % over those peaks. The factor 2 used before planned the
# LoRA update 11 % high.
BACKWARD_BLOCKS = 1.2
NO_GRAD_BLOCKS = 0.6
# Estimates (not measured on a GPU).
REWARD_GIB_PER_VIDEO = 0.5  # VideoAlign no-grad working set per video (3,024 vision patches, ~1.5k LM tokens)
ENCODE_GIB = 1.0  # Qwen2.5-VL-7B forward over one 1,108-token prompt with output_hidden_states (29 x 1108 x 3584 bf16)
TYPICAL_PROMPT_TOKENS = 120  # valid MLLM tokens of a typical training prompt (an assumption: see the docstring)


def fp8_dequantize_bytes(elem: int) -> int:
    """Bytes per weight element a --fp8_base layer allocates while its weight is dequantized to a compute dtype of
    `elem` bytes, on top of the FP8 bytes it holds (counted in the policy weights). torchao 0.18's
    `_dequantize_affine_float8` (what Float8Tensor.dequantize and its weight-only linear run) is
    `qdata.to(float32) * scale` then `.to(dtype)`: an fp32 copy (4) and the fp32 product (4) live together, and the
    product with its cast to the compute dtype (bf16: 2; fp32: none, `.to` returns the product itself). Measured
    on the CPU, not assumed: torch.profiler's allocator records over one layer's dequantize
    (tests/test_plan_memory.py::test_the_fp8_dequantization_transient_is_what_torchao_allocates): 10 bytes per
    element in bf16, 8 in fp32; 11 and 9 with the FP8 byte itself. For the largest block linear, the 6D x D
    modulation (25.2M elements at the real width D = 2048): 0.234 GiB in bf16 (the 2 bytes per element planned
    before: 0.047 GiB)."""
    return 8 + (elem if elem != 4 else 0)

# ------------------------------------------------------------------------------------------------- parameters


def build_transformer(config: dict, device: str = "meta"):
    """HunyuanVideo15Transformer3DModel from a config dict on `device` (meta: shapes only, no memory)."""
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device(device):
        return HunyuanVideo15Transformer3DModel.from_config(config)


def count_transformer(model, *, use_lora: bool = False, lora_r: int = 8, lora_alpha: int = 16,
                      lora_target_modules: list[str] | None = None) -> dict:
    """Exact counts from a (meta) transformer: total, per block, trainable, Muon's share of the trainable, and the
    blocks' linear weights (what --fp8_base quantizes: elements, output rows, the largest one)."""
    import torch

    from sage_grpo.models.fp8 import quantized_bytes
    from sage_grpo.models.lora import setup_trainable
    from sage_grpo.optim import goes_to_muon

    blocks = model.transformer_blocks
    linears = [m.weight for m in blocks.modules() if isinstance(m, torch.nn.Linear)]
    out = {
        "total": sum(p.numel() for p in model.parameters()),
        "num_blocks": len(blocks),
        "per_block": sum(p.numel() for p in blocks[0].parameters()) if len(blocks) else 0,
        "block_linear": sum(w.numel() for w in linears),
        "block_linear_fp8": sum(quantized_bytes(*w.shape) for w in linears),  # their bytes under --fp8_base
        "largest_linear": max((w.numel() for w in linears), default=0),
    }
    if use_lora:
        setup_trainable(model, use_lora=True, lora_r=lora_r, lora_alpha=lora_alpha,
                        lora_target_modules=lora_target_modules or [])
    else:
        model.requires_grad_(True)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out["trainable"] = sum(p.numel() for _, p in trainable)
    out["muon"] = sum(p.numel() for n, p in trainable if goes_to_muon(n, p))
    out["frozen"] = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return out


def count_frozen_parts() -> dict:
    """Exact parameter counts of the VAE, text encoders and VideoAlign reward model (meta device)."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15
    from transformers import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        Qwen2VLConfig,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Config,
        T5EncoderModel,
    )

    from sage_grpo.rewards.videoalign_ckpt import VideoRewardNet

    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):
        vae = AutoencoderKLHunyuanVideo15()
        te = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN25_VL_7B_TEXT))
        byt5 = T5EncoderModel(T5Config(**BYT5_SMALL))
        siglip = SiglipVisionModel(SiglipVisionConfig(**SIGLIP_SO400M))
        reward = VideoRewardNet(Qwen2VLConfig(text_config=QWEN2_VL_2B_TEXT, vision_config=QWEN2_VL_2B_VISION,
                                              vocab_size=QWEN2_VL_2B_TEXT["vocab_size"]), 3)
    return {"vae": n(vae), "vae_config": dict(vae.config), "text_encoder": n(te), "byt5": n(byt5), "reward": n(reward),
            "image_encoder": n(siglip)}


# ------------------------------------------------------------------------------------------------- activations


def block_activation_bytes(*, batch: int, video_tokens: int, text_tokens: int, dim: int, heads: int, mlp_dim: int,
                           elem: int, attention: str = "valid", sp: int = 1, checkpointing: bool = False,
                           ln_stat_bytes: int = 4) -> int:
    """Bytes one HunyuanVideo-1.5 dual-stream block saves for backward, per rank.

    batch: samples in the forward (a CFG pair counts 2). video_tokens: the whole sequence (split over sp here);
    text_tokens: encoder tokens the block sees (valid ones for the project's processor, 1,985 for diffusers').
    elem: bytes of the compute dtype. ln_stat_bytes: LayerNorm mean/rstd (fp32 on CUDA, the compute dtype on CPU).
    Per token, both streams (what saved_tensors_hooks shows, tests/test_plan_memory.py):
      6 x [D]  modulated / normed / gated hidden states        2 x [D]  inputs of the out and FF projections
      4 x [D]  q, k before and after the RMS QK-norm          2 x [M]  FF hidden (GELU input and output)
      2 x [D]  fp32 copies of q, k for the rotary embedding (only when the compute dtype is not fp32)
      2 x [H]  fp32 RMS-norm rstd                               4        LayerNorm mean / rstd
    Attention, after the Ulysses all-to-all (all tokens, heads / sp): q, k, v, out [D / sp] + fp32 logsumexp [H / sp].
    With batch > 1 one more [D / sp] per token (a contiguous copy of the attention output).
    Per sample: 8 x [D] modulation vectors. diffusers' processor also saves its dense mask [S, S] in the compute
    dtype (not split by sp). With gradient checkpointing only the block inputs are kept: [D] per local token.
    """
    if sp < 1 or heads % sp:
        raise SageGRPOError(f"sp {sp} must divide the head count {heads}")
    local_video = math.ceil(video_tokens / sp)
    local_tokens = local_video + text_tokens  # text replicated on every sp rank
    if checkpointing:
        return batch * local_tokens * dim * elem
    rotary = 2 * dim * 4 if elem != 4 else 0
    per_token = (12 * dim + 2 * mlp_dim) * elem + rotary + 2 * heads * 4 + 4 * ln_stat_bytes
    attn = (video_tokens + text_tokens) * (4 * dim * elem + heads * 4) // sp
    if batch > 1:  # the attention output is copied to a contiguous [B, S, D] (a free view when B = 1)
        attn += (video_tokens + text_tokens) * dim * elem // sp
    total = local_tokens * per_token + attn + 8 * dim * elem
    if attention == "diffusers":
        total += (video_tokens + text_tokens) ** 2 * elem
    return batch * total


def text_cache_bytes(*, prompt_tokens: int, glyph_tokens: int, elem: int, trimmed: bool = True,
                     text_dim: int = QWEN25_VL_7B_TEXT["hidden_size"], byt5_dim: int = BYT5_SMALL["d_model"]) -> int:
    """Bytes the text-embedding cache holds for one prompt: its valid tokens (the project), or the pipeline's
    padded 1,000 + 256 tokens with both masks (what every rank held before)."""
    if trimmed:
        return (prompt_tokens * text_dim + glyph_tokens * byt5_dim) * elem
    return (TEXT_LEN_MLLM * text_dim + TEXT_LEN_BYT5 * byt5_dim + TEXT_LEN_MLLM + TEXT_LEN_BYT5) * elem


def text_cache_host(cfg: Config, opts: PlanOptions) -> dict:
    """Host memory per rank of the text-embedding cache for `opts.num_prompts` distinct prompts."""
    e = torch_dtype(cfg.model.dtype).itemsize
    one = text_cache_bytes(prompt_tokens=opts.prompt_tokens, glyph_tokens=opts.glyph_tokens, elem=e)
    in_memory = opts.num_prompts * one
    return {
        "num_prompts": opts.num_prompts, "prompt_tokens": opts.prompt_tokens, "glyph_tokens": opts.glyph_tokens,
        "per_prompt_mb": one / 1e6,
        "in_memory_gb": in_memory / 1e9,  # one process without --text_embedding_cache_dir: it holds every prompt
        "with_cache_dir_gb": 0.0,  # read per batch from the files (one page-cache copy per node)
        "files_gb": in_memory / 1e9,
        "padded_before_gb": opts.num_prompts * text_cache_bytes(prompt_tokens=0, glyph_tokens=0, elem=e,
                                                                  trimmed=False) / 1e9,
        # under torchrun post_train defaults the cache dir to output_dir/text_embeddings
        "per_rank_gb": 0.0 if (cfg.model.text_embedding_cache_dir or opts.world_size > 1) else in_memory / 1e9,
        "encoded_per_rank": math.ceil(opts.num_prompts / opts.world_size),
    }


# ------------------------------------------------------------------------------------------------- the plan


@dataclass
class PlanOptions:
    world_size: int = 8
    gpu_memory_gib: float = 80.0
    text_tokens: int = 256
    attention: str = "valid"
    fsdp_param_dtype: str = ""  # "" = the compute dtype
    overhead_gib: float = 2.0
    num_prompts: int = 10_000  # distinct prompts of the run (train + validation + negative), for the text cache
    prompt_tokens: int = TYPICAL_PROMPT_TOKENS
    glyph_tokens: int = 0
    gpus_per_node: int = 8


def plan(cfg: Config, opts: PlanOptions, counts: dict | None = None, frozen: dict | None = None,
         tcfg: dict | None = None) -> dict:
    """The per-GPU budget of `cfg` on `opts.world_size` GPUs. counts / frozen: precomputed parameter counts. tcfg: the
    transformer config to plan (default: the --pretrained_transformer_version one; scripts/gpu_check.py passes the
    config of the model it measures, e.g. fewer blocks or tiny)."""
    version = cfg.model.pretrained_transformer_version
    tcfg = tcfg or transformer_config(version)
    if tcfg is None:
        raise SageGRPOError(f"no transformer config for --pretrained_transformer_version {version!r} in diffusers' "
                            f"converter; planned versions: {', '.join(planned_versions())}")
    if opts.world_size < 1:
        raise SageGRPOError(f"--world_size must be >= 1, got {opts.world_size}")
    if opts.gpus_per_node < 1:
        raise SageGRPOError(f"--gpus_per_node must be >= 1, got {opts.gpus_per_node}")
    if opts.gpu_memory_gib <= 0:
        raise SageGRPOError(f"--gpu_memory_gib must be > 0, got {opts.gpu_memory_gib}")
    if opts.attention not in ("valid", "diffusers"):
        raise SageGRPOError(f"--attention must be valid or diffusers, got {opts.attention!r}")
    if not 0 < opts.text_tokens <= TEXT_LEN_MLLM + TEXT_LEN_BYT5:
        raise SageGRPOError(f"--text_tokens must be in 1..{TEXT_LEN_MLLM + TEXT_LEN_BYT5}, got {opts.text_tokens}")
    if opts.num_prompts < 0:
        raise SageGRPOError(f"--num_prompts must be >= 0, got {opts.num_prompts}")
    if not 1 <= opts.prompt_tokens <= TEXT_LEN_MLLM:
        raise SageGRPOError(f"--prompt_tokens must be in 1..{TEXT_LEN_MLLM}, got {opts.prompt_tokens}")
    if not 0 <= opts.glyph_tokens <= TEXT_LEN_BYT5:
        raise SageGRPOError(f"--glyph_tokens must be in 0..{TEXT_LEN_BYT5}, got {opts.glyph_tokens}")
    heads, head_dim = tcfg["num_attention_heads"], tcfg["attention_head_dim"]
    validate(cfg, opts.world_size, num_heads=heads, training=False)  # a plan needs no prompt file

    m, p, d, r, o = cfg.model, cfg.parallel, cfg.data, cfg.rollout, cfg.optim
    if counts is None:
        counts = count_transformer(build_transformer(tcfg), use_lora=m.use_lora, lora_r=m.lora_r,
                                   lora_alpha=m.lora_alpha, lora_target_modules=m.lora_target_modules)
    if frozen is None:
        frozen = count_frozen_parts()
    sp, dp = p.sp_size, dp_degree(cfg, opts.world_size)
    dp_shard = dp // p.dp_replicate
    shard = dp_shard * sp if p.enable_fsdp else 1
    e = torch_dtype(m.dtype).itemsize
    mw = torch_dtype(m.master_weight_type).itemsize
    re = torch_dtype(cfg.reward.reward_dtype).itemsize
    gathered = torch_dtype(opts.fsdp_param_dtype or m.dtype).itemsize
    autocast = mw != e  # predict_velocity autocasts when the master dtype differs from the compute dtype

    # geometry
    from sage_grpo.rollout import latent_shape

    class _V:  # latent_shape reads these attributes of a VAE config
        pass

    vcfg = _V()
    for k, v in frozen["vae_config"].items():
        setattr(vcfg, k, v)
    C, F, H, W = latent_shape(vcfg, r.sample_n_frames, r.height, r.width)
    video_tokens = (F // tcfg["patch_size_t"]) * (H // tcfg["patch_size"]) * (W // tcfg["patch_size"])
    i2v = tcfg.get("task_type") == "i2v"
    # I2V: the 729 SigLIP tokens are valid encoder tokens (T2V's are zeros, masked, cut by the valid-token processor)
    text_tokens = (opts.text_tokens + (IMAGE_TOKENS if i2v else 0) if opts.attention == "valid"
                   else TEXT_LEN_MLLM + TEXT_LEN_BYT5 + IMAGE_TOKENS)
    dim = heads * head_dim
    mlp_dim = int(dim * tcfg["mlp_ratio"])
    cfg_mult = 2 if r.cfg_scale != 1 else 1
    fwd_batch = o.mini_batch_size_per_update * cfg_mult
    L = counts["num_blocks"]
    act = dict(video_tokens=video_tokens, text_tokens=text_tokens, dim=dim, heads=heads, mlp_dim=mlp_dim, elem=e,
               attention=opts.attention, sp=sp)
    block_full = block_activation_bytes(batch=fwd_batch, **act)
    block_ckpt = block_activation_bytes(batch=fwd_batch, checkpointing=True, **act)

    # memory terms (bytes per GPU)
    total, trainable, muon = counts["total"], counts["trainable"], counts["muon"]
    t = {}
    # LoRA: the frozen base is loaded in the compute dtype (post_train.load_policy), the adapters in the master dtype
    # (`total` counts the base transformer; LoRA's `trainable` adapters come on top of it)
    # --fp8_base (sage_grpo.models.fp8): the blocks' linear weights in one byte per element plus an fp32 scale per
    # output row, the rest of the base in the compute dtype
    base = total * e if not m.fp8_base else (total - counts["block_linear"]) * e + counts["block_linear_fp8"]
    t["policy weights"] = (base + trainable * mw if m.use_lora else total * mw) / shard
    t["gradients"] = trainable * mw / shard
    states = (muon * 1 + (trainable - muon) * 2) if o.use_muon else trainable * 2
    t["optimizer state"] = states * mw / shard
    from sage_grpo.kl import uses_position_kl

    uses_pos = uses_position_kl(cfg.kl)
    if not uses_pos:
        anchor = 0.0
    elif m.use_lora:
        anchor = (2 * trainable * mw / shard) if cfg.kl.use_moving_KL else 0.0  # adapter copy + swap buffer
    else:
        anchor = total * mw / shard
    anchor_offloaded = uses_pos and not m.use_lora and cfg.kl.reference_mode_offload
    t["anchor (resident)"] = 0.0 if anchor_offloaded else anchor
    # Offloaded under FSDP2 (models/parallelize.build_sharded_anchor, CPUOffloadPolicy): only the gathered blocks of
    # its forward come to the GPU (counted in "unsharded blocks"); without FSDP post_train moves the whole anchor in
    # for its phase.
    t["anchor (on GPU in its phase)"] = 0.0 if (anchor_offloaded and p.enable_fsdp) else anchor
    t["vae weights"] = frozen["vae"] * e
    te_bytes = (frozen["text_encoder"] + frozen["byt5"]) * e
    t["text encoders before offload"] = te_bytes
    t["text encoders after offload"] = 0.0 if m.offload_text_encoder else te_bytes
    # I2V: SigLIP encodes the reference images at setup (encode phase) and is offloaded with the text encoders; a
    # gpu_check-style frozen dict without it counts none
    ie_bytes = frozen.get("image_encoder", 0) * e if i2v else 0.0
    t["image encoder before offload"] = ie_bytes
    t["image encoder after offload"] = 0.0 if m.offload_text_encoder else ie_bytes
    # --reward_model remote: the reward runs on its own GPUs (scripts/serve_reward.py); the policy's ranks decode and
    # send the frames, so they hold neither the reward model nor its forward
    names = [n.strip().lower() for n in cfg.reward.reward_model.split(",") if n.strip()]
    remote = names == ["remote"]
    # the VideoAlign model is held only by a run that scores with it (a built-in weight-free reward holds none)
    local_reward = {"reward model": frozen["reward"] * re if "videoalign_local" in names or remote else 0.0}
    t["reward model"] = 0.0 if remote else local_reward["reward model"]
    B, T = d.batch_size, r.grpo_sampling_steps
    lat = C * F * H * W
    cond = (TEXT_LEN_MLLM * tcfg["text_embed_dim"] + TEXT_LEN_BYT5 * tcfg["text_embed_2_dim"]) * e + (
        TEXT_LEN_MLLM + TEXT_LEN_BYT5) * e
    image = (IMAGE_TOKENS * tcfg["image_embed_dim"] + C * H * W) * e if i2v else 0  # SigLIP tokens + frame-0 latent
    # fp32 latents, log-probs, text cond (+uncond), each sample's image conditioning (shared by both CFG branches)
    t["trajectory"] = B * ((T + 1) * lat * 4 + T * 4 + cond * cfg_mult + image)
    block_params = counts["per_block"] + (trainable / L if m.use_lora else 0)
    root_params = total - L * counts["per_block"]  # embedders, refiner, norm_out / proj_out (+ LoRA outside blocks)
    keep_rollout = p.enable_fsdp and shard > 1 and not p.rollout_reshard_after_forward
    # --fp8_base under FSDP2: the block linears are gathered as their FP8 bytes and fp32 scales (sage_grpo.models.fp8:
    # integer parameters, which FSDP2's mixed precision leaves alone), the rest in the gathered dtype
    fp8_saving = (counts["block_linear"] * gathered - counts["block_linear_fp8"]) if m.fp8_base else 0
    gathered_model = total * gathered - fp8_saving  # bytes of the whole transformer gathered
    if p.enable_fsdp:  # two blocks (current + prefetch) and the root unit, gathered in the compute dtype
        t["unsharded blocks (fwd)"] = 2 * (block_params * gathered - fp8_saving / L) + root_params * gathered
        t["unsharded block grad (bwd)"] = block_params * 4 if not m.use_lora else trainable / L * 4
    else:
        t["unsharded blocks (fwd)"] = trainable * e if autocast else 0.0  # autocast's cached bf16 weight copies
        t["unsharded block grad (bwd)"] = 0.0
    # --rollout_reshard_after_forward False (parallel/fsdp.keep_unsharded): every unit stays gathered through the
    # rollout, so the rollout holds the whole transformer in the gathered dtype instead of two blocks + the root
    t["unsharded model (rollout, kept gathered)"] = gathered_model if keep_rollout else 0.0
    t["activations: one block, full"] = block_full
    t["activations: one block, checkpointed"] = block_ckpt
    if m.enable_gradient_checkpointing:  # every block's input, one block recomputed and its backward
        t["activations (update)"] = L * block_ckpt + BACKWARD_BLOCKS * block_full
    else:  # every block's saved tensors and the backward's transients: the checkpointed case less its recomputed
        # block (an estimate: this case was not measured on a GPU)
        t["activations (update)"] = L * block_full + (BACKWARD_BLOCKS - 1) * block_full
    t["no-grad working set"] = NO_GRAD_BLOCKS * block_full  # rollout / anchor forwards: one block's transients
    # --fp8_base: a layer's weight dequantized to the compute dtype while it runs (forward, and the backward's input
    # gradient), one at a time, through torchao's fp32 copy and product (fp8_dequantize_bytes: as measured)
    t["fp8 weight dequantized (transient)"] = counts["largest_linear"] * fp8_dequantize_bytes(e) if m.fp8_base else 0.0
    scale = (r.sample_n_frames * r.height * r.width) / GPU_FACTS["vae_decode_pixels"]
    t["vae decode"] = GPU_FACTS["vae_decode_gib"][m.vae_tiling] * GIB * scale
    t["decoded frames"] = B * r.sample_n_frames * 3 * r.height * r.width * 4
    rb = cfg.reward.reward_batch_size or B
    held = bool(local_reward["reward model"])
    local_reward["reward forward (est)"] = REWARD_GIB_PER_VIDEO * GIB * min(rb, B) if held else 0.0
    t["reward forward (est)"] = 0.0 if remote else local_reward["reward forward (est)"]
    t["text encoder forward (est)"] = ENCODE_GIB * GIB
    t["overhead (est)"] = opts.overhead_gib * GIB

    # ShardedMuon (parallel/muon.py): each rank gathers the whole matrices it owns in bf16 and orthogonalises them
    # (estimate: the gathered updates + Newton-Schulz workspace ~ 2x); plain torch Muon without FSDP works in place.
    muon_gather = 2 * (muon if o.use_muon else 0) * 2 / shard if p.enable_fsdp and shard > 1 else 0.0
    t["muon gather + Newton-Schulz (est)"] = muon_gather
    accum = o.gradient_accumulation_steps > 1
    grads_idle = t["gradients"] if accum else 0.0

    def phases_of(t: dict) -> dict:
        base = t["policy weights"] + t["optimizer state"] + t["anchor (resident)"] + t["vae weights"] + t[
            "reward model"] + t["overhead (est)"] + t["image encoder after offload"]
        phases = {
            # post_train encodes every prompt and image before the policy loads (setup): the text encoders, SigLIP
            # and the VAE beside the reward model, no policy, optimizer or anchor yet
            "encode": t["vae weights"] + t["reward model"] + t["overhead (est)"] + t["text encoders before offload"]
            + t["image encoder before offload"] + t["text encoder forward (est)"],
            "rollout": base + t["text encoders after offload"] + t["trajectory"]
            + (t["unsharded model (rollout, kept gathered)"] if keep_rollout else t["unsharded blocks (fwd)"])
            + t["no-grad working set"] + t["fp8 weight dequantized (transient)"] + grads_idle,
            "decode+reward": base + t["text encoders after offload"] + t["trajectory"] + grads_idle
            + max(t["vae decode"], t["decoded frames"] + t["reward forward (est)"]),
            "anchor": base - t["anchor (resident)"] + t["anchor (on GPU in its phase)"]
            + t["text encoders after offload"] + t["trajectory"] + t["unsharded blocks (fwd)"]
            + t["no-grad working set"] + t["fp8 weight dequantized (transient)"] + grads_idle,
            "update": base + t["text encoders after offload"] + t["trajectory"] + t["gradients"]
            + t["unsharded blocks (fwd)"] + t["unsharded block grad (bwd)"] + t["activations (update)"]
            + t["fp8 weight dequantized (transient)"],
            "optimizer step": base + t["text encoders after offload"] + t["trajectory"] + t["gradients"]
            + t["muon gather + Newton-Schulz (est)"],
        }
        return phases

    phases = phases_of(t)
    # the same run with the reward the other way (local VideoAlign on every rank <-> remote): what moving it saves
    other = phases_of({**t, **({k: 0.0 for k in local_reward} if not remote else local_reward)})
    local_peak, remote_peak = (max(other.values()), max(phases.values())) if remote else (
        max(phases.values()), max(other.values()))
    peak_phase = max(phases, key=phases.get)
    peak = phases[peak_phase]

    # collectives per step (one rollout round) and per rank: how many forwards / backwards the loop runs
    from sage_grpo.grpo import stochastic_steps
    from sage_grpo.schedule import num_train_timesteps, sigma_schedule
    from sage_grpo.sde import step_variance

    sig = sigma_schedule(T, r.flow_shift)
    var = step_variance(r.sde_type, sig[:-1], sig[1:], r.eta, sigma_max=sig[1], sage_clamp=r.sage_sigma_clamp)
    chunks = math.ceil(B / o.mini_batch_size_per_update)
    loop = {"rollout_forwards": T * chunks,
            "update_steps": chunks * num_train_timesteps(int(stochastic_steps(var).numel()), o.timestep_fraction),
            "optimizer_steps": 1 / o.gradient_accumulation_steps}
    loop["anchor_forwards"] = loop["update_steps"] if uses_pos else 0
    traffic = step_traffic(
        model_bytes=gathered_model, trainable=trainable, muon=muon if o.use_muon else 0,
        shard=shard if p.enable_fsdp else 1, replicate=p.dp_replicate if p.enable_fsdp else 1,
        world=opts.world_size, gpus_per_node=opts.gpus_per_node, keep_rollout=keep_rollout, **loop)
    return {
        "setting": {
            "version": version, "world_size": opts.world_size, "sp_size": sp, "dp_degree": dp,
            "dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "fsdp": p.enable_fsdp, "shard_ranks": shard,
            "batch_size": B, "num_generations": d.num_generations, "videos_per_round": B * dp,
            "gradient_accumulation_steps": o.gradient_accumulation_steps,
            "videos_per_update": B * dp * o.gradient_accumulation_steps,
            "video": f"{r.sample_n_frames}x{r.height}x{r.width}", "latent": [C, F, H, W],
            "video_tokens": video_tokens, "video_tokens_per_rank": math.ceil(video_tokens / sp),
            "text_tokens": text_tokens, "attention": opts.attention, "forward_batch": fwd_batch,
            "dtype": m.dtype, "master_weight_type": m.master_weight_type, "use_lora": m.use_lora,
            "fp8_base": m.fp8_base,
            "lora_r": m.lora_r if m.use_lora else None, "optimizer": "muon+adamw" if o.use_muon else "adamw",
            "gradient_checkpointing": m.enable_gradient_checkpointing,
            "anchor": ("none" if not uses_pos else "lora adapter copy" if m.use_lora else
                       "offloaded to CPU" if anchor_offloaded else "resident"),
            "offload_text_encoder": m.offload_text_encoder, "vae_tiling": m.vae_tiling,
            "rollout_reshard_after_forward": p.rollout_reshard_after_forward, "gpus_per_node": opts.gpus_per_node,
        },
        "params": {"transformer": total, "per_block": counts["per_block"], "num_blocks": L, "trainable": trainable,
                   "muon": muon if o.use_muon else 0, "vae": frozen["vae"], "text_encoder": frozen["text_encoder"],
                   "byt5": frozen["byt5"], "reward": frozen["reward"],
                   "image_encoder": frozen.get("image_encoder", 0) if i2v else 0},
        "terms_gib": {k: v / GIB for k, v in t.items()},
        "phases_gib": {k: v / GIB for k, v in phases.items()},
        "peak_gib": peak / GIB, "peak_phase": peak_phase, "gpu_memory_gib": opts.gpu_memory_gib,
        "fits": peak / GIB <= opts.gpu_memory_gib,
        "headroom_gib": opts.gpu_memory_gib - peak / GIB,
        "reward": {"remote": remote, "local_gib": sum(local_reward.values()) / GIB,
                   "peak_saving_gib": (local_peak - remote_peak) / GIB},
        "host_text_cache": text_cache_host(cfg, opts),
        # I2V image cache (sage_grpo/models/image_cond.py): per distinct image, in each process's memory without a
        # cache directory (one image per prompt assumed), nothing with one (read per batch from the files)
        "host_image_cache": {"per_image_mb": image / 1e6, "in_memory_gb": opts.num_prompts * image / 1e9,
                             "per_rank_gb": 0.0 if (m.text_embedding_cache_dir or opts.world_size > 1)
                             else opts.num_prompts * image / 1e9} if i2v else None,
        "loop": loop,
        "traffic": traffic,
    }


# ------------------------------------------------------------------------------------------------- traffic


def step_traffic(*, model_bytes: float, trainable: int, muon: int, shard: int, replicate: int,
                 world: int, gpus_per_node: int, keep_rollout: bool, rollout_forwards: int, update_steps: int,
                 anchor_forwards: int, optimizer_steps: float) -> dict:
    """Bytes each rank sends (= receives) in the FSDP2 / HSDP / ShardedMuon collectives of one step, by kind, and
    whether the kind's group crosses a node boundary (an estimate: bandwidth-optimal volumes, latency ignored).

    Volumes per rank (ring / bandwidth-optimal algorithms): an all-gather or reduce-scatter of D bytes over n ranks
    moves (n - 1) / n x D, an all-reduce 2 (n - 1) / n x D. Ranks are laid out contiguously (dist.build_mesh: a shard
    group is `shard` consecutive ranks, a replica group takes one rank from each shard group), so the shard group
    crosses nodes iff shard > gpus_per_node and the replica group iff the world does. A collective over a group that
    crosses nodes is paced by InfiniBand; inside a node by NVLink.
    - parameter all-gathers of the whole model (`model_bytes`: in the gathered dtype, an FP8 base's block linears in
      one byte per element) per forward (every unit): the rollout's forwards
      (one gather for the whole rollout when kept gathered), the update's forward and backward (FSDP2 reshards after
      forward and gathers again for backward: 2 per update step), the anchor's forwards (KL_pos: its sharded copy,
      or the policy with its adapters swapped under LoRA; fewer right after an anchor refresh);
    - gradient reduce-scatter (fp32) after every backward over the shard group, and with HSDP an all-reduce of the
      shard over the replicas (FSDP2 reduces at every backward: the loop does not skip gradient sync between micro-
      batches);
    - ShardedMuon: the bf16 update rows of every Muon matrix to its owner and back (gather + scatter) per optimizer
      step (optimizer_steps per step = 1 / gradient_accumulation_steps).
    Not counted: Ulysses all-to-alls (activations, inside a node by the launch check), the small reductions
    (rewards, metrics, gradient norm) and the text-encoding / reward models (replicated).
    -> {kind: {"gib": per rank per step, "inter_node": bool}, "inter_node_gib", "intra_node_gib",
        "model_gather_gib": one whole-model all-gather}
    """
    ag = (shard - 1) / shard  # all-gather / reduce-scatter factor over the shard group
    gather = ag * model_bytes
    shard_crosses, replica_crosses = shard > gpus_per_node, replicate > 1 and world > gpus_per_node
    kinds = {
        "param all-gather: rollout": (gather * (1 if keep_rollout else rollout_forwards), shard_crosses),
        "param all-gather: update fwd + bwd": (gather * 2 * update_steps, shard_crosses),
        "param all-gather: anchor": (gather * anchor_forwards, shard_crosses),
        "grad reduce-scatter (fp32)": (ag * trainable * 4 * update_steps, shard_crosses),
        "grad all-reduce over replicas (fp32)": (
            2 * (replicate - 1) / replicate * trainable * 4 / shard * update_steps, replica_crosses),
        "ShardedMuon gather + scatter (bf16)": (2 * ag * muon * 2 / shard * optimizer_steps, shard_crosses),
    }
    out: dict = {k: {"gib": v / GIB, "inter_node": x} for k, (v, x) in kinds.items()}
    out["inter_node_gib"] = sum(v for v, x in kinds.values() if x) / GIB
    out["intra_node_gib"] = sum(v for v, x in kinds.values() if not x) / GIB
    out["model_gather_gib"] = gather / GIB
    return out


def layout_choices(cfg: Config, opts: PlanOptions, counts: dict, frozen: dict) -> list[dict]:
    """Peak memory and traffic per step of the same run under each FSDP layout: shard over every rank
    (dp_replicate 1) or HSDP with one node per shard group (dp_replicate = world / gpus_per_node), each with the
    rollout re-gathering per forward or kept gathered. Layouts the geometry does not allow are left out."""
    import copy

    rows = []
    node_replicas = opts.world_size // opts.gpus_per_node
    for replicate in dict.fromkeys((1, node_replicas)):
        for reshard in (True, False):
            c = copy.deepcopy(cfg)
            c.parallel.dp_replicate, c.parallel.rollout_reshard_after_forward = replicate, reshard
            try:
                pl = plan(c, opts, counts, frozen)
            except SageGRPOError:
                continue
            s = pl["setting"]
            rows.append({"dp_replicate": replicate, "shard_ranks": s["shard_ranks"],
                         "rollout": "re-gather per forward" if reshard else "kept gathered",
                         "peak_gib": pl["peak_gib"], "peak_phase": pl["peak_phase"], "fits": pl["fits"],
                         "inter_node_gib": pl["traffic"]["inter_node_gib"],
                         "intra_node_gib": pl["traffic"]["intra_node_gib"]})
    return rows


# ------------------------------------------------------------------------------------------------- a way to fit


REMOTE_URL = "http://rewardhost:8000"  # a placeholder: the remote reward's plan does not depend on the server


def whole_groups_batch(cfg: Config, world_size: int) -> int:
    """The smallest --batch_size >= cfg's whose videos per step (batch_size x dp) make whole groups of
    --num_generations (what post_train.py requires; the memory of a rank depends on its batch_size only)."""
    dp, g = dp_degree(cfg, world_size), cfg.data.num_generations
    step = g // math.gcd(g, dp)  # batch_size x dp is a multiple of g iff batch_size is a multiple of this
    return max(cfg.data.batch_size, step) if cfg.data.batch_size % step == 0 else (
        cfg.data.batch_size // step + 1) * step


def _frames(cfg: Config, opts: PlanOptions, fits_at) -> tuple[list[str], Callable] | None:
    """--sample_n_frames: the longest 4k + 1 video shorter than cfg's that fits (`fits_at(frames)`), down to a
    quarter of its length (that floor when none fits)."""
    n = cfg.rollout.sample_n_frames
    floor = max(5, 4 * ((n - 1) // 16) + 1)
    if n - 4 < floor:
        return None
    frames = next((f for f in range(n - 4, floor - 1, -4) if fits_at(f)), floor)
    return [f"--sample_n_frames {frames}"], lambda c: setattr(c.rollout, "sample_n_frames", frames)


def memory_changes(cfg: Config, opts: PlanOptions) -> list[tuple[list[str], Callable]]:
    """The settings that lower a rank's peak and that cfg does not use yet -> [(flags, apply(cfg))], in the order
    `fitting_changes` prefers one that fits alone: the FP8 base (a LoRA run), LoRA, bf16 master weights, the reward
    on its own GPUs, CFG off, fewer videos per rank, the memory switches (checkpointing, offloads, VAE tiling,
    micro-batch 1) and the FSDP2 layout under torchrun. Shorter videos are `_frames` (their length depends on what
    fits)."""
    m, p, r, o, k = cfg.model, cfg.parallel, cfg.rollout, cfg.optim, cfg.kl
    out: list[tuple[list[str], Callable]] = []

    def change(flags: list[str], **values) -> None:
        def apply(c: Config) -> None:
            for name, value in values.items():
                setattr(getattr(c, FIELDS[name][0]), name, value)
        out.append((flags, apply))

    # first: it keeps the run's videos, batch, reward and recipe (the frozen base is stored in FP8, 7.6 GiB less at
    # the real size) and trains the adapters alike (docs/performance.md, "Learning on an FP8 base")
    if m.use_lora and not m.fp8_base:
        change(["--fp8_base True"], fp8_base=True)
    if not m.use_lora:
        change(["--use_lora True"], use_lora=True)
    if m.master_weight_type == "fp32" and m.dtype != "fp32":
        change([f"--master_weight_type {m.dtype}"], master_weight_type=m.dtype)
    if "videoalign_local" in [n.strip().lower() for n in cfg.reward.reward_model.split(",")]:
        change(["--reward_model remote --reward_url URL"], reward_model="remote", reward_url=REMOTE_URL)
    if r.cfg_scale != 1:
        change(["--cfg_scale 1"], cfg_scale=1.0)
    g = min(cfg.data.num_generations, 2)  # the smallest group with an advantage: two videos of a prompt
    fewer = dataclasses.replace(cfg.data, batch_size=1, num_generations=g)
    b = whole_groups_batch(dataclasses.replace(cfg, data=fewer), opts.world_size)
    if b < cfg.data.batch_size:
        change([f"--batch_size {b}"] + ([f"--num_generations {g}"] if g != cfg.data.num_generations else []),
               batch_size=b, num_generations=g)
    if not m.enable_gradient_checkpointing:
        change(["--enable_gradient_checkpointing True"], enable_gradient_checkpointing=True)
    if not m.offload_text_encoder:
        change(["--offload_text_encoder True"], offload_text_encoder=True)
    if not m.vae_tiling:
        change(["--vae_tiling True"], vae_tiling=True)
    if o.mini_batch_size_per_update > 1:
        change(["--mini_batch_size_per_update 1"], mini_batch_size_per_update=1)
    if not m.use_lora and not k.reference_mode_offload:
        change(["--reference_mode_offload True"], reference_mode_offload=True)
    if opts.world_size > 1 and not p.enable_fsdp:
        change(["--enable_fsdp True"], enable_fsdp=True)
    if opts.world_size > 1 and p.enable_fsdp and not p.rollout_reshard_after_forward:
        change(["--rollout_reshard_after_forward True"], rollout_reshard_after_forward=True)
    return out


def fitting_changes(cfg: Config, opts: PlanOptions, counts: dict, frozen: dict) -> dict:
    """What would make a plan that does not fit `opts.gpu_memory_gib` fit, each change re-planned:
    "alone": every change of `memory_changes` (and shorter videos) applied alone, largest saving first;
    "together": those changes applied one after another until the plan fits, with the peak after each: first the
    change that fits alone with the run's video, when one does (the first in `memory_changes`' order: --fp8_base
    for a LoRA run), then the others by saving, the video length last (the longest that fits); "fits": whether the
    last one does.
    -> {"alone": [{"flags", "peak_gib", "saving_gib", "fits"}], "together": [...the same...], "fits": bool}"""
    import copy

    lora_counts: dict = {}

    def peak(c: Config) -> float | None:
        n = counts
        if c.model.use_lora != cfg.model.use_lora:  # LoRA's trainable adapters: counted on meta once
            if not lora_counts:
                lora_counts.update(count_transformer(
                    build_transformer(transformer_config(c.model.pretrained_transformer_version)), use_lora=True,
                    lora_r=c.model.lora_r, lora_alpha=c.model.lora_alpha,
                    lora_target_modules=c.model.lora_target_modules))
            n = lora_counts
        try:
            return plan(c, opts, n, frozen)["peak_gib"]
        except SageGRPOError:  # a change this config does not allow (e.g. a window longer than the video)
            return None

    def applied(c: Config, apply) -> Config:
        c = copy.deepcopy(c)
        apply(c)
        return c

    def frames_of(c: Config) -> tuple[list[str], Callable] | None:
        def fits_at(f: int) -> bool:
            value = peak(applied(c, lambda x: setattr(x.rollout, "sample_n_frames", f)))
            return value is not None and value <= opts.gpu_memory_gib
        return _frames(c, opts, fits_at)

    base = plan(cfg, opts, counts, frozen)["peak_gib"]
    alone, shorter = [], frames_of(cfg)
    for order, (flags, apply) in enumerate([*memory_changes(cfg, opts), *([shorter] if shorter else [])]):
        value = peak(applied(cfg, apply))
        if value is not None and base - value >= 0.05:  # a change that saves nothing worth naming is left out
            alone.append({"flags": " ".join(flags), "peak_gib": value, "saving_gib": base - value,
                          "fits": value <= opts.gpu_memory_gib, "apply": apply, "order": order})
    alone.sort(key=lambda row: -row["saving_gib"])
    together, current, value = [], cfg, base
    video = next((row for row in alone if row["flags"].startswith("--sample_n_frames")), None)
    others = [row for row in alone if row is not video]
    # one flag that fits keeps the run's video: offered first (the first in memory_changes' order when several do)
    one = min((row for row in others if row["fits"]), key=lambda row: row["order"], default=None)
    others = ([one] if one else []) + [row for row in others if row is not one]
    for row in others + ([video] if video else []):
        if value <= opts.gpu_memory_gib:
            break
        if row is video:  # the longest video that fits with the changes before it
            flags, apply = frames_of(current) or shorter
            row = {"flags": " ".join(flags), "apply": apply}
        nxt = applied(current, row["apply"])
        new = peak(nxt)
        if new is None or new >= value:
            continue
        current, value = nxt, new
        together.append({"flags": row["flags"], "peak_gib": value, "saving_gib": base - value,
                         "fits": value <= opts.gpu_memory_gib})
    for row in alone:
        del row["apply"], row["order"]
    return {"alone": alone, "together": together, "fits": value <= opts.gpu_memory_gib}


# ------------------------------------------------------------------------------------------------- validation


def validate_against_gpu_facts() -> list[dict]:
    """Predicted vs H100-measured per-block activations (diffusers processor, bf16) and VAE decode."""
    g = GPU_FACTS["block_geometry"]
    rows = []
    for (b, ck), measured in GPU_FACTS["block_act_gib"].items():
        pred = block_activation_bytes(batch=b, elem=2, attention="diffusers", checkpointing=ck, **{
            k: g[k] for k in ("video_tokens", "dim", "heads", "mlp_dim")}, text_tokens=g["text_tokens"]) / GIB
        note = ""
        if ck:
            # gpu_probe measured peak(4 blocks) - peak(2 blocks) / 2 with a bf16 model: with checkpointing the peak
            # is at the end of backward, when every block's bf16 gradient is allocated: max(grad, saved inputs).
            grad = 151_056_896 * 2 / GIB
            note = f"saved inputs {pred:.3f}; the probe's difference of peaks = max(bf16 block grad {grad:.3f}, inputs)"
            pred = max(pred, grad)
        rows.append({"what": f"block activations, batch {b}, checkpointing {'on' if ck else 'off'}",
                     "predicted_gib": pred, "measured_gib": measured, "ratio": pred / measured, "note": note})
    for tiling, measured in GPU_FACTS["vae_decode_gib"].items():
        rows.append({"what": f"VAE decode 352x624x81, tiling {'on' if tiling else 'off'}",
                     "predicted_gib": measured, "measured_gib": measured, "ratio": 1.0,
                     "note": "the planner uses this measurement (scaled by video volume at other sizes)"})
    return rows



def whole_groups(cfg: Config, world_size: int) -> str | None:
    """A --batch_size whose videos per step do not make whole groups (post_train.py refuses it) is raised to the
    smallest that does, so that the plan is of a run that trains -> the note saying so (None when it already does)."""
    if world_size < 1 or world_size % cfg.parallel.sp_size:
        return None  # validate says what is wrong
    b, d = whole_groups_batch(cfg, world_size), cfg.data
    if b == d.batch_size:
        return None
    dp = dp_degree(cfg, world_size)
    note = (f"--batch_size {d.batch_size} on {dp} data-parallel rank(s) makes {d.batch_size * dp} videos per step, not "
            f"whole groups of --num_generations {d.num_generations} (post_train.py refuses it): planned with "
            f"--batch_size {b}, the smallest that does (or lower --num_generations)")
    d.batch_size = b
    return note



def plan_run(cfg: Config, opts: PlanOptions, counts: dict | None = None, frozen: dict | None = None) -> dict:
    """The plan scripts/plan_memory.py prints: `plan` of cfg (a --batch_size of incomplete groups raised to whole
    ones, said in "note"), the FSDP2 layouts of the same run under torchrun ("choices") and, when it does not fit,
    what would ("changes"). counts / frozen: precomputed parameter counts (counted on meta when None)."""
    note = whole_groups(cfg, opts.world_size)
    m = cfg.model
    if counts is None and transformer_config(m.pretrained_transformer_version) is not None:
        counts = count_transformer(build_transformer(transformer_config(m.pretrained_transformer_version)),
                                   use_lora=m.use_lora, lora_r=m.lora_r, lora_alpha=m.lora_alpha,
                                   lora_target_modules=m.lora_target_modules)
    frozen = frozen if frozen is not None else count_frozen_parts()
    pl = plan(cfg, opts, counts, frozen)
    pl["note"] = note
    if opts.world_size > 1 and cfg.parallel.enable_fsdp:
        pl["choices"] = layout_choices(cfg, opts, counts, frozen)
    if not pl["fits"]:
        pl["changes"] = fitting_changes(cfg, opts, counts, frozen)
    return pl


# ------------------------------------------------------------------------------------------------- before a run


# the transformer config keys that make the architecture (and its parameter count) the planner counts
_ARCHITECTURE = ("num_layers", "num_single_layers", "num_refiner_layers", "num_attention_heads",
                 "attention_head_dim", "mlp_ratio", "in_channels", "out_channels", "patch_size", "patch_size_t",
                 "text_embed_dim", "text_embed_2_dim", "image_embed_dim")


def checkpoint_plan_config(cfg: Config) -> dict:
    """The transformer config to plan the run `cfg` with: its --pretrained_transformer_version's real config, when
    the checkpoint it will load (located as post_train.py locates it; no weights read) has that architecture.
    Raises SageGRPOError saying why not (no checkpoint there yet, another size: a tiny or cut-down model, whose
    text encoders and VAE the planner does not count)."""
    from sage_grpo.models.authors_layout import authors_transformer_config
    from sage_grpo.models.loading import locate_model, read_transformer_config

    m = cfg.model
    real = transformer_config(m.pretrained_transformer_version)
    if real is None:
        raise SageGRPOError(f"no transformer config for --pretrained_transformer_version "
                            f"{m.pretrained_transformer_version!r}; planned versions: {', '.join(planned_versions())}")
    loc = locate_model(m.pretrained_model_root, m.model_path, m.pretrained_transformer_version)
    if loc.layout == "diffusers":
        found = read_transformer_config(loc.root / "transformer")
    else:
        found = authors_transformer_config(loc.root / "transformer" / loc.version, loc.version)
    differ = [k for k in _ARCHITECTURE if k in found and k in real and found[k] != real[k]]
    if differ:
        raise SageGRPOError(f"the transformer at {loc.root} is not the real {m.pretrained_transformer_version} "
                            "architecture the planner counts (" + ", ".join(f"{k} {found[k]} vs {real[k]}"
                                                                             for k in differ[:3]) + ")")
    return real


def device_fit_line(cfg: Config, world_size: int, gpu_memory_gib: float, *, counts: dict | None = None,
                    frozen: dict | None = None) -> str | None:
    """The decision of post_train.py's preflight for a GPU of `gpu_memory_gib`: None when the plan of `cfg` on
    `world_size` GPUs fits; otherwise one line with the peak and the planner's top suggestion (the changes that
    together make it fit, `fitting_changes`), or that nothing it knows does. A pure function of its arguments (no
    CUDA); counts / frozen: precomputed parameter counts."""
    import copy

    cfg = copy.deepcopy(cfg)  # whole_groups may raise the batch; the run's config stays as it is
    opts = PlanOptions(world_size=world_size, gpu_memory_gib=gpu_memory_gib)
    pl = plan_run(cfg, opts, counts, frozen)
    if pl["fits"]:
        return None
    ch = pl["changes"]
    if ch["fits"]:
        advice = "it fits with " + " ".join(r["flags"] for r in ch["together"]).replace("URL", "<server URL>")
    else:
        advice = ("nothing the planner knows makes it fit: more GPUs (--enable_fsdp True, --sp_size) or a smaller "
                  "video (--height, --width)")
    return (f"warning: memory plan: peak {pl['peak_gib']:.1f} GiB ({pl['peak_phase']}) does not fit this GPU's "
            f"{gpu_memory_gib:.1f} GiB; {advice} (python scripts/plan_memory.py with this run's flags and "
            f"--world_size {world_size} --gpu_memory_gib {gpu_memory_gib:.1f} lists every change); going on")


def check_device_memory(cfg: Config, world_size: int, device, log: Callable[[str], None] = print) -> None:
    """post_train.py's preflight on a CUDA device, before any model loads: the plan of this run against the
    device's memory, one line from `device_fit_line` when it does not fit (a warning: the run goes on), once per
    launch (global rank 0). Nothing on another device. A run the planner cannot plan (a tiny or cut-down model, no
    checkpoint there yet, a planner error) is said in one line and goes on; the built-in tiny model is not planned
    and says nothing."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("RANK", "0") != "0":
        return
    from sage_grpo.models.tiny_checkpoint import TINY_CHECKPOINT_DIR

    if cfg.model.model_path and Path(cfg.model.model_path) == Path(TINY_CHECKPOINT_DIR):
        return
    gib = torch.cuda.get_device_properties(device).total_memory / GIB
    try:
        checkpoint_plan_config(cfg)  # the model it will load is the one the planner counts
        line = device_fit_line(cfg, world_size, gib)
    except Exception as e:  # noqa: BLE001 - advice only: whatever the planner cannot do, the run goes on
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        line = f"memory plan: not planned ({first}); going on"
    if line:
        log(line)
