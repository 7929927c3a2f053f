"""Configuration: dataclasses are the single source of defaults; a YAML file and `--flag value` CLI go on top.

Layering: defaults < YAML file (`--config path.yaml`, grouped sections as in `dump_yaml`) < CLI flags. Flag names
are the authors' (snake_case, one namespace across groups), so their launch scripts run unchanged. Booleans accept
`--flag` alone or `--flag True|False|1|0|yes|no|on|off`; lists are space separated.

`validate(cfg, world_size)` rejects impossible batch geometry with messages that say what to change. The resolved
config is written into the output directory by `dump_yaml` and loads back identically with `load_config`. A resumed
run's settings are the saved run's, with the command line's flags on top (`resume_settings`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from .errors import SageGRPOError
from .recipes import RECIPE_FLOP_RATIOS, RECIPES, recipe_settings
from .sde import CPS_LOGPROB_MODES, SAGE_SIGMA_CLAMP, SAMPLERS, check_sage_schedule
from .window import ODE_SOLVERS

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "DataConfig",
    "RolloutConfig",
    "RewardConfig",
    "KLConfig",
    "OptimConfig",
    "ValidationConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "Config",
    "GROUPS",
    "build_parser",
    "load_config",
    "config_to_dict",
    "config_from_dict",
    "dump_yaml",
    "resume_settings",
    "LAUNCH_KEYS",
    "validate",
    "check_fp8_matmul_flags",
    "parse_bool",
    "parse_size",
    "REWARD_MIN_PIXELS",
    "REWARD_MAX_PIXELS",
    "REWARD_SAMPLE_FPS",
    "VIDEO_FPS",
    "dp_degree",
    "DTYPES",
    "torch_dtype",
]

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPES = tuple(TORCH_DTYPES)
# VideoAlign's frame preprocessing (qwen_vl_utils) and the frame rate of decoded videos: the defaults of the
# reward flags, of the reward builders (sage_grpo.rewards) and of scripts/score_videos.py
REWARD_MIN_PIXELS = 128 * 28 * 28  # 100352
REWARD_MAX_PIXELS = 256 * 28 * 28  # 200704
REWARD_SAMPLE_FPS = 2.0
VIDEO_FPS = 24
# what the vlm_judge template asks for (--judge_scale): a score from 1 to 10, or yes / no
JUDGE_SCALES = ("1-10", "yes_no")
_TRUE = {"true", "1", "yes", "on", "y", "t"}
_FALSE = {"false", "0", "no", "off", "n", "f"}


# --attention_backend: "auto" (the processors' default: diffusers' active backend, torch's SDPA unless
# DIFFUSERS_ATTN_BACKEND names another) or a backend of diffusers' attention dispatcher that needs no mask: torch's
# SDPA choosing its kernel (native) or forced to one (_native_math / _native_flash / _native_efficient /
# _native_cudnn), flex attention, flash-attn 2 / 3 from their packages or from the Hub (`kernels`), flash 4 from the
# Hub, SageAttention (no backward: generation only) and xformers. Which of them this machine runs is probed, not
# assumed (`check_attention_backend`).
ATTENTION_BACKENDS = ("auto", "native", "_native_math", "_native_flash", "_native_efficient", "_native_cudnn", "flex",
                      "flash", "flash_hub", "_flash_3", "_flash_3_hub", "flash_4_hub", "sage", "sage_hub", "xformers")


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A dataclass field with help text (and allowed values) for the CLI and the docs."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """The HunyuanVideo-1.5 policy: where its weights are and how it is trained."""

    pretrained_model_root: str = opt("ckpts", "Root of the authors' checkpoint layout (`hf download "
                                              "tencent/HunyuanVideo-1.5`); also the default home of VideoReward and "
                                              "Qwen2-VL-2B-Instruct.")
    model_path: str = opt("", "A diffusers-layout HunyuanVideo-1.5 directory (model_index.json, transformer/, vae/, "
                              "...). Empty: use pretrained_model_root in the authors' layout.")
    pretrained_transformer_version: str = opt("480p_t2v", "Sub-folder of <pretrained_model_root>/transformer to load "
                                                          "in the authors' layout.")
    dtype: str = opt("bf16", "Compute dtype of the transformer forward (autocast) and of the frozen parts.", DTYPES)
    master_weight_type: str = opt("fp32", "Dtype of the trained (master) weights and optimizer state; with "
                                          "--use_lora the adapters', while the frozen base weights stay in --dtype.",
                                  DTYPES)
    enable_gradient_checkpointing: bool = opt(True, "Recompute transformer block activations in backward (saves "
                                                    "memory, ~30% slower).")
    compile: bool = opt(False, "Compile each of the transformer's dual-stream blocks with torch.compile (fullgraph, "
                               "dynamic shapes; the blocks share one compiled function) for the rollout, re-scoring, "
                               "anchor and validation forwards, and in generate.py. The first forwards of a run pay "
                               "the compilation (a few graphs, see sage_grpo/models/compile.py); inductor on the CPU "
                               "needs a C compiler.")
    attention_backend: str = opt("auto", "Kernel of the transformer's valid-token attention: a backend of diffusers' "
                                         "attention dispatcher (native: torch's SDPA choosing flash / memory-"
                                         "efficient / cuDNN; _native_*: one SDPA kernel; flex; flash, _flash_3 "
                                         "(packages) and *_hub (Hub kernels); sage (no backward: generation only); "
                                         "xformers). auto keeps diffusers' active backend (native unless "
                                         "DIFFUSERS_ATTN_BACKEND says otherwise). One the machine cannot run is "
                                         "refused before any model loads, naming the ones it can.",
                                 ATTENTION_BACKENDS)
    use_lora: bool = opt(False, "Train LoRA adapters (peft) instead of the full transformer.")
    lora_r: int = opt(8, "LoRA rank.")
    lora_alpha: int = opt(16, "LoRA alpha (scale = alpha / r).")
    lora_dropout: float = opt(0.0, "LoRA dropout (the authors' flag). Must be 0: the rollout's log-probs come from "
                                   "the policy without dropout, so re-scoring with it would move the ratio off 1 and "
                                   "the clip would silently zero those pairs.")
    lora_target_modules: list[str] = opt([], "Module names that get LoRA adapters; empty = every linear layer of the "
                                             "transformer blocks.")
    pretrained_lora_path: str = opt("", "A LoRA adapter (safetensors file or peft directory) to load before training "
                                        "or generation.")
    fp8_base: bool = opt(False, "With --use_lora: store the frozen base's transformer-block linear weights in "
                                "float8_e4m3fn with per-output-channel scales (torchao; half the bytes of bf16), "
                                "dequantized as each layer runs; the rollout, re-scoring, anchor and generate.py "
                                "use the same quantized base; FSDP2 shards it (each rank quantizes its rows as it "
                                "loads). Needs torchao (the lora extra).")
    fp8_matmul: bool = opt(False, "With --fp8_base: run the quantized layers as FP8 matrix products (activations "
                                  "quantized per row; CUDA compute capability 8.9 or above, --dtype bf16) instead of "
                                  "dequantizing the weights to --dtype; the backward takes the input's gradient from "
                                  "the dequantized weight. generate.py follows a run's setting.")
    vae_tiling: bool = opt(True, "Decode rollouts and validation videos with the VAE in tiles (diffusers' "
                                 "enable_tiling): 9 GiB instead of 30 GiB peak for one 81x352x624 video on an H100, "
                                 "1.5x the time; no effect below the tile size.")
    offload_text_encoder: bool = opt(True, "Free the text encoders (GPU and host memory) once every prompt is encoded "
                                           "and cached, before the policy loads, and move SigLIP off the GPU; a "
                                           "prompt not cached later loads them again (the authors keep the 7B "
                                           "encoder resident).")
    text_embedding_cache_dir: str = opt("", "Directory of an on-disk text-embedding cache keyed by prompt and encoder. "
                                            "Empty: in memory for one process; under torchrun "
                                            "output_dir/text_embeddings, so each rank holds none of it (ranks read a "
                                            "batch's files when they need them) instead of every prompt.")


@dataclass
class ParallelConfig:
    """Distributed layout: dp_degree = world_size / sp_size."""

    enable_fsdp: bool = opt(True, "Shard the policy, its gradients, optimizer state and anchor with FSDP2 (per "
                                  "transformer block, then the root) over the dp_shard x sp ranks; one process (no "
                                  "torchrun) trains unsharded. False = every rank holds the whole model and gradients "
                                  "are all-reduced.")
    sp_size: int = opt(1, "Ulysses sequence-parallel degree; must divide world_size and the head count (16). The "
                          "authors' argparse default is 8 and their launch scripts use 2; ours is 1 so that one "
                          "process runs out of the box (the paper configs set 2).")
    dp_replicate: int = opt(1, "HSDP replication degree (FSDP shards within groups of dp_degree / dp_replicate ranks).")
    rollout_reshard_after_forward: bool = opt(False, "FSDP2 during the rollout: False = every unit is all-gathered "
                                                     "by its first forward and kept gathered to the end of the rollout "
                                                     "(one all-gather per unit per rollout instead of one per forward: "
                                                     "T x batch_size / mini_batch_size_per_update forwards; costs the "
                                                     "whole transformer in --dtype on every GPU for the rollout, see "
                                                     "scripts/plan_memory.py); True = re-gather for every forward "
                                                     "(least memory). The update always reshards after forward.")
    dist_timeout_minutes: int = opt(60, "How long a collective waits for the slowest rank before the job fails "
                                        "(torch's NCCL default is 10). Sized for a checkpoint save of ~100 GB of "
                                        "FSDP2 shards and optimizer state to a shared filesystem and for the first "
                                        "step's prompt encoding and model loading on a busy node.")


@dataclass
class DataConfig:
    """Prompts and GRPO grouping."""

    train_video_csv: str = opt("", "Training prompts: CSV with column `prompt` (optional `index`, `seed`, "
                                   "`ref_image_path`), .txt one per line, or .jsonl.")
    batch_size: int = opt(2, "Videos per data-parallel rank per rollout.")
    num_generations: int = opt(4, "Group size G: rollouts per prompt. A group may span consecutive data-parallel "
                                  "ranks.")
    num_workers: int = opt(2, "Accepted for the authors' launch scripts; post_train.py reads the prompt list once at "
                              "start and uses no loader workers, so every value behaves the same.")


@dataclass
class RolloutConfig:
    """The SDE rollout: sampler, schedule, guidance, sizes."""

    sde_type: str = opt("sage_grpo", "Rollout sampler. Log-probs of different samplers are on different scales (cps "
                                     "drops the Gaussian constants by default), so clip ranges do not transfer between "
                                     "them.", SAMPLERS[1:])
    eta: float = opt(0.5, "Noise level of the SDE (the variance scales with eta^2; for cps s_t = sigma_{t+1} sin(eta "
                          "pi / 2)).")
    cfg_scale: float = opt(6.0, "Classifier-free guidance scale in rollout and training forwards; 1 turns CFG off.")
    neg_prompt: str = opt("", "Negative prompt for CFG.")
    flow_shift: float = opt(5.0, "Shift s of the rollout sigma schedule sigma = s u / (1 + (s - 1) u).")
    grpo_sampling_steps: int = opt(20, "Number of SDE steps T per rollout.")
    sample_n_frames: int = opt(81, "Frames per rollout video (4k + 1; 81 -> 21 latent frames).")
    height: int = opt(352, "Rollout video height in pixels (multiple of 16; 352x624 is the authors' '480' bucket).")
    width: int = opt(624, "Rollout video width in pixels (multiple of 16).")
    use_same_noise: bool = opt(False, "One initial noise per group (the G rollouts of a prompt differ only by SDE "
                                      "noise).")
    sde_window_start: int = opt(0, "First SDE step of the rollout (MixGRPO's window): steps before the window and "
                                   "after it are deterministic ODE steps, carry no log-prob and are not trained; "
                                   "--timestep_fraction and the equalizer act on the window's steps. 0 with "
                                   "--sde_window_size 0 = every step SDE (the paper).")
    sde_window_size: int = opt(0, "SDE steps in the window; 0 = from --sde_window_start to the last step.")
    sde_window_stride: int = opt(0, "Sliding window (MixGRPO): move the window this many steps later every "
                                    "--sde_window_every optimizer updates, back to --sde_window_start when it would "
                                    "pass the last step; 0 = a fixed window. Needs --sde_window_size.")
    sde_window_every: int = opt(25, "Optimizer updates between two moves of a sliding window (MixGRPO's "
                                    "iters_per_group 25).")
    shared_prefix: bool = opt(False, "Run the ODE steps before the window once per prompt instead of once per sample "
                                     "(with --use_same_noise the G samples of a group are identical until the window "
                                     "starts): (G - 1) / G fewer forwards there, the same videos. Needs "
                                     "--use_same_noise and --sde_window_start >= 1.")
    ode_solver: str = opt("euler", "Solver of the ODE steps after the SDE window (they are never trained, only the "
                                   "video they end in is scored): euler = the schedule's own steps (the paper, "
                                   "MixGRPO); unipc = diffusers' UniPCMultistepScheduler (2nd order, bh2, on the "
                                   "schedule's sigmas), which reaches the same end point in fewer steps (--ode_steps; "
                                   "MixGRPO-Flash's higher-order solver).", ODE_SOLVERS)
    ode_steps: int = opt(0, "Solver steps of the ODE after the SDE window, on a subset of the schedule's sigmas ending "
                            "at 0; 0 = one per schedule step after the window. Fewer steps, fewer rollout forwards: "
                            "with unipc 2-3 steps stay within bf16 rounding of the many-step end point on the tiny "
                            "model (docs/performance.md).")
    recipe: str = opt("", "A named recipe of sage_grpo.recipes: sets its keys (sampler window, CFG, solver, trained "
                          "steps), explicit flags on top; '' = none (the paper's recipe unless other flags say "
                          "otherwise). Model FLOPs per step against the paper's at 81x352x624, T 20, 2 videos a "
                          "rank: " + ", ".join(f"{n} {r:.2f}x" for n, r in RECIPE_FLOP_RATIOS.items()) + ".",
                      ("", *RECIPES))
    video_fps: int = opt(VIDEO_FPS, "Frame rate of decoded videos (rewards sample frames relative to it; mp4 files use "
                                    "it).")
    cps_logprob: str = opt("peer", "cps log-prob: peer = -(x' - mean)^2 averaged (what every CPS implementation uses), "
                                   "normalized = Gaussian log-density.", CPS_LOGPROB_MODES)
    sage_sigma_clamp: float = opt(SAGE_SIGMA_CLAMP, "sage_grpo clamps sigma_t to at most this value inside the log so "
                                                    "that the first step stays finite (paper App. A.3).")


@dataclass
class RewardConfig:
    """The reward: VideoAlign (VideoReward) or a built-in reward, and the composite weights."""

    reward_model: str = opt("videoalign_local", "Reward name (videoalign_local, or a built-in / metric reward), an "
                                                "import path of your own reward (package.module:factory or "
                                                "path/to/file.py:factory), several joined by commas; see "
                                                "docs/rewards.md.")
    reward_model_path: str = opt("", "VideoReward checkpoint directory; empty = <pretrained_model_root>/VideoReward.")
    reward_base_model_path: str = opt("", "Local Qwen2-VL-2B-Instruct directory (config and processor); empty = "
                                          "<pretrained_model_root>/Qwen2-VL-2B-Instruct. Never fetched at run time.")
    reward_weights: str = opt('{"VQ":0.5,"MQ":0.5,"TA":1.0}', "JSON weights of the composite reward (case-insensitive "
                                                              "keys). Setting A: {\"VQ\":1,\"MQ\":1,\"TA\":1}; Setting "
                                                              "B (default, best): VQ 0.5, MQ 0.5, TA 1.0. Empty = each "
                                                              "reward's own default weights.")
    reward_combine: str = opt("weighted_sum", "How training combines the components into each video's reward "
                                              "before the group advantage: weighted_sum = sum_k w_k r_k (the "
                                              "paper); component_norm = sum_k w_k z_k with z_k = (r_k - "
                                              "mean_group r_k) / (std_group r_k + 1e-8), each component normalised "
                                              "within its group first (GDPO-style), so that no component dominates "
                                              "by its scale. Logs and validation keep the weighted sum.",
                              ("weighted_sum", "component_norm"))
    reward_optional: str = opt("", "Components (case-insensitive, joined by commas) whose failure (NaN) does not mask "
                                   "a video in training: its score counts as the group's mean of that component "
                                   "(with component_norm: its term is left out). A failed component not named here "
                                   "masks the video. Empty = every component required.")
    reward_checkpoint_mode: str = opt("v3", "Key remapping of the VideoReward state dict: v1/v2 older layouts, v3 "
                                            "current transformers.", ("v1", "v2", "v3"))
    reward_checkpoint_step: int = opt(-1, "Which checkpoint-<step>/ of the VideoReward directory to load; -1 = the "
                                          "newest.")
    reward_max_pixels: int = opt(REWARD_MAX_PIXELS, "Max pixels per frame fed to VideoAlign (resized to multiples of "
                                                    "28 within it).")
    reward_min_pixels: int = opt(REWARD_MIN_PIXELS, "Min pixels per frame fed to VideoAlign (VideoAlign's "
                                                    "frame-loading default).")
    reward_sample_fps: float = opt(REWARD_SAMPLE_FPS, "Frames per second sampled from the video for VideoAlign (81 "
                                                      "frames at 24 fps -> 6 frames).")
    reward_batch_size: int = opt(0, "Videos per reward forward (per request for the remote reward); 0 = all "
                                    "videos of the rank at once.")
    max_failed_reward_steps: int = opt(3, "Stop, after writing a checkpoint, when this many steps in a row had no "
                                          "finite reward on any rank (such steps train nothing and are counted in "
                                          "train/failed_reward_steps); 0 = never stop.")
    reward_dtype: str = opt("bf16", "Dtype of the reward model.", DTYPES)
    reward_url: str = opt("", "For --reward_model remote: the reward server(s) (scripts/serve_reward.py), "
                              "http://host:port, several separated by commas (replicas of one reward share the load; "
                              "servers of different rewards are combined). Token: the SAGE_REWARD_TOKEN environment "
                              "variable.")
    reward_timeout: float = opt(120.0, "Seconds a reward server request (remote) or a judge request (vlm_judge) "
                                       "may take before it is retried.")
    reward_overlap: bool = opt(True, "When every reward works on the CPU (remote, vlm_judge, world_caption, "
                                     "world_size, world_motion, world_motion_right, a user's reward with runs_on_cpu "
                                     "= True), any --sp_size: each chunk of --mini_batch_size_per_update videos is "
                                     "decoded as soon as it is sampled and scored in a worker thread, so scoring "
                                     "overlaps the rollout of the next chunk (the same samples and scores as in "
                                     "order). Rewards on the accelerator and the demo rewards score in order after "
                                     "the rollout.")
    reward_retries: int = opt(3, "Retries of a failed reward server request (remote: exponential backoff from 1 "
                                 "s) or judge request (vlm_judge: the openai client's backoff, 0.5 s doubling up "
                                 "to 8 s, or the server's Retry-After) before its videos score NaN.")
    clip_model_path: str = opt("", "openai/clip-vit-large-patch14 directory for the clipscore reward/metric; empty = "
                                   "<pretrained_model_root>/clip-vit-large-patch14.")
    pickscore_model_path: str = opt("", "yuvalkirstain/PickScore_v1 directory for the pickscore reward/metric; empty = "
                                        "<pretrained_model_root>/PickScore_v1.")
    pickscore_processor_path: str = opt("", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K directory (PickScore's processor); "
                                            "empty = <pretrained_model_root>/CLIP-ViT-H-14-laion2B-s32B-b79K.")
    judge_url: str = opt("", "For --reward_model vlm_judge: the OpenAI-compatible chat server of the judge VLM "
                             "(vllm serve, SGLang, transformers serve), http://host:port (/v1 may follow). API "
                             "key: the SAGE_JUDGE_API_KEY environment variable; OPENAI_API_KEY only when the URL is "
                             "https://api.openai.com; no key over plain http to a host other than this machine "
                             "unless --judge_allow_http_key.")
    judge_model: str = opt("", "Model name the judge requests ask for (e.g. vLLM's --served-model-name); empty = "
                               "the one model the judge server lists.")
    judge_template: str = opt("", "Text file of the judge's prompt: {prompt} stands for the video's prompt, "
                                  "{frames} for the number of frames sent; empty = the built-in template of "
                                  "--judge_scale (docs/rewards.md).")
    judge_scale: str = opt("1-10", "What the judge's template asks for. 1-10: a score from 1 to 10; the reward is "
                                   "(E - 1) / 9, E the expected score under the answer's log-probabilities, or "
                                   "the number answered where the server returns none. yes_no: yes or no; the "
                                   "reward is P(yes), or 1 / 0.", JUDGE_SCALES)
    judge_frames: int = opt(4, "Frames of each video sent to the judge, evenly spaced from the first to the "
                               "last.")
    judge_video: bool = opt(False, "Send the judge the frames as one mp4 video_url part instead of one image_url "
                                   "part per frame (for servers whose model takes video).")
    judge_concurrency: int = opt(8, "Judge requests in flight at once per rank (one request per video).")
    judge_max_tokens: int = opt(16, "Tokens the judge may answer: room for a number or a word and a short preamble "
                                    "(\"Score: 7\"). An answer cut off there scores NaN (the start-up check stops "
                                    "with this flag); a reasoning judge, which thinks before it answers "
                                    "(<think>...</think>, the score read after it), needs hundreds to thousands.")
    judge_allow_http_key: bool = opt(False, "Send SAGE_JUDGE_API_KEY to a plain-http --judge_url on another host "
                                            "(readable by anyone on the path); off: such a URL gets no key.")


@dataclass
class KLConfig:
    """Dual trust region and the adaptive KL coefficient (paper Sec. 3.2.2, App. A.6)."""

    kl_weight: float = opt(1e-5, "Switches the KL term on when > 0; also lambda_max of the adaptive coefficient and, "
                                 "unless kl_target is set, its target.")
    kl_coef: float = opt(1e-7, "Initial KL coefficient (start of the linear warm-up).")
    kl_min_coef: float = opt(1e-7, "Lower bound lambda_min of the adaptive KL coefficient.")
    kl_target: float | None = opt(None, "Target KL D_target of the adaptive controller; unset = kl_weight (the "
                                        "authors' mapping).")
    kl_warmup_updates: int = opt(100, "Optimizer updates of linear warm-up from kl_coef to kl_weight (K in paper Eq. "
                                      "41).")
    kl_history: int = opt(10, "Number H of recent KL values the controller averages.")
    kl_adapt_direction: str = opt("paper", "paper: KL above 1.5x target multiplies the coefficient by 0.9 (as the "
                                           "paper states); classic: by 1.1 (PPO-style "
                                           "tightening).", ("paper", "classic"))
    use_moving_KL: bool = opt(True, "Refresh the anchor from the policy every update_ref_model_step updates (False: "
                                    "fixed anchor = the initial model).")
    update_ref_model_step: int = opt(10, "Optimizer updates between anchor refreshes.")
    use_dual_kl: bool = opt(True, "Add the step-wise term KL(pi_theta || pi_{k-1}) to the anchor term (dual trust "
                                  "region). Step-wise only: --use_dual_kl --dual_kl_moving_weight 0.")
    dual_kl_moving_weight: float = opt(1.0, "beta_pos: weight of the anchor (position) term in the dual KL.")
    dual_kl_step_weight: float = opt(0.1, "beta_vel: weight of the step-wise (velocity) term in the dual KL.")
    kl_compute_mode: str = opt("rollout_phase", "rollout_phase: anchor means computed right after the rollout and kept "
                                                "on CPU; training_phase: inside the "
                                                "update.", ("rollout_phase", "training_phase"))
    reference_mode_offload: bool = opt(False, "Keep the anchor model on CPU when it is not in use.")


@dataclass
class OptimConfig:
    """The policy update: optimizer, PPO clipping, timestep selection, equalizer."""

    learning_rate: float = opt(1e-5, "Peak learning rate.")
    weight_decay: float = opt(0.01, "Decoupled weight decay.")
    adam_beta1: float = opt(0.95, "AdamW beta1 (the AdamW beside Muon, or alone with --use_muon False); 0.95 as the "
                                  "authors' code (torch's default is 0.9).")
    adam_beta2: float = opt(0.95, "AdamW beta2; 0.95 as the authors' code (torch's default is 0.999).")
    adam_eps: float = opt(1e-8, "AdamW epsilon (the authors' and torch's 1e-8).")
    max_steps: int = opt(10000, "Training steps (rollout + update rounds).")
    warmup_steps: int = opt(0, "Linear learning-rate warm-up in optimizer updates.")
    gradient_accumulation_steps: int = opt(1, "Rollout rounds (steps) whose gradients are accumulated into one "
                                              "optimizer update: an update sees rounds x batch_size x dp videos (dp = "
                                              "world_size / sp_size): on 8 GPUs with batch_size 2, the 64 videos of "
                                              "the authors' 64-GPU step take 4 rounds at sp 1 and 8 rounds at sp 2. "
                                              "The KL controller, the warm-up and the anchor refresh count optimizer "
                                              "updates.")
    updates_per_rollout: int = opt(1, "Optimizer updates per rollout round, each on a disjoint share of the round's "
                                      "samples (the rollout's chunks in turn, by their place in the step's batch: "
                                      "the same shares on any number of GPUs; 1 = the authors': the ratio of the "
                                      "update is then exactly 1 and clipping never acts; > 1 lets the ratio "
                                      "leave 1). Needs gradient_accumulation_steps 1.")
    max_grad_norm: float = opt(1.0, "Gradient-norm clip; <= 0 disables it.")
    use_muon: bool = opt(True, "Muon for >= 2-D weight matrices and AdamW for the rest; False = AdamW everywhere.")
    seed: int = opt(42, "Base seed. Every draw is seeded by a hash of it with what names the draw: rollout noise with "
                        "(step, prompt text, seed column and reference image, the group's position in the step, "
                        "generation, diffusion step), timestep permutations with (step, video), the prompt shuffle "
                        "with the epoch; results do not depend on the rank count.")
    clip_range: float = opt(1e-4, "PPO clip range of the ratio (tiny because log-probs are averaged over latent "
                                  "elements).")
    adv_clip_max: float = opt(5.0, "Advantages are clamped to [-adv_clip_max, adv_clip_max].")
    timestep_fraction: float = opt(1.0, "Fraction of the T steps trained per sample: int(T * fraction), as the "
                                        "authors' code takes it (0.33 of 20 trains 6); at least one step.")
    enable_timestep_permutation: bool = opt(True, "Train the selected steps of each sample in a random order (else in "
                                                  "sampling order).")
    group_timesteps: bool = opt(False, "Flash-GRPO's grouping: the G samples of a group train the same steps (drawn "
                                       "per group and step), so a group's advantages weigh log-prob ratios taken at "
                                       "one noise level; else each sample draws its own steps.")
    use_grad_balancing: bool = opt(True, "Weight each step's policy loss by the gradient-norm equalizer S_t (paper Eq. "
                                         "9).")
    mini_batch_size_per_update: int = opt(1, "Samples per forward/backward micro-step of the update.")


@dataclass
class ValidationConfig:
    """Validation videos during training."""

    validation_interval: int = opt(100, "Steps between validation runs; 0 disables validation.")
    validate_at_step0: bool = opt(False, "Run validation before the first step.")
    valid_video_csv: str = opt("", "Validation prompts file (same formats as train_video_csv).")
    validation_prompts: list[str] = opt([], "Validation prompts given on the command line (used when valid_video_csv "
                                            "is empty).")
    validate_video_length: int = opt(81, "Frames of validation videos (4k + 1; the authors' scripts use 121).")
    validation_timestep_shift: float = opt(5.0, "Schedule shift for validation sampling.")
    validation_fixed_size: str = opt("480x864", "Validation video size HxW (multiples of 16).")
    validation_num_inference_steps: int = opt(40, "ODE steps of validation sampling.")
    validation_guidance_scale: float = opt(6.0, "CFG scale of validation sampling.")
    validation_seed: int = opt(930, "Seed of validation sampling.")
    validation_metrics: list[str] = opt(["auto"], "Held-out metrics validation reports beside the trained reward "
                                                  "(val/<name>), computed on its videos: groups components (the "
                                                  "trained reward's components --reward_weights leaves out), "
                                                  "statistics (brightness, saturation, contrast, motion), world (the "
                                                  "synthetic world's fidelity metrics; world-caption prompts only), "
                                                  "drift (distance from the first validation's videos), or a reward "
                                                  "name (clipscore, pickscore, ...: its model is loaded for "
                                                  "validation); auto = components, statistics, drift and, when every "
                                                  "validation prompt is a world caption, world; none = no held-out "
                                                  "metric and no hacking check.")
    hacking_reward_rise: float = opt(1.0, "The hacking check warns when the trained validation reward has risen by "
                                          "more than this many spreads (its standard deviation over the validation "
                                          "videos, pooled with the first validation's) since the first validation "
                                          "...")
    hacking_metric_drop: float = opt(1.0, "... while a held-out metric moved the wrong way (fell; a statistic: "
                                          "either way) by more than this many of its own spreads; once per metric "
                                          "per run (val/hacking_warnings counts them).")


@dataclass
class CheckpointConfig:
    """Output directory and resumable checkpoints."""

    output_dir: str = opt("./outputs", "Run directory: checkpoints, samples, logs and the resolved config (used as "
                                       "given).")
    save_interval: int = opt(100, "Steps between checkpoints (a final one is always written).")
    resume_from_checkpoint: str = opt("", "Checkpoint directory to resume from, or 'latest' for the newest complete "
                                          "one in output_dir. The run continues with its saved settings; flags given "
                                          "on the command line override them (the --config file's values do not).")
    checkpoints_total_limit: int = opt(0, "Keep at most this many checkpoints (oldest deleted first); 0 keeps all.")
    overwrite_output_dir: bool = opt(False, "Start a new run in an --output_dir that already holds one: its "
                                            "checkpoints, metrics, curves, samples, validation references and "
                                            "TensorBoard logs are deleted first. Without it such a folder is refused "
                                            "(continue it with --resume_from_checkpoint latest).")


@dataclass
class LoggingConfig:
    """Metrics."""

    log_interval: int = opt(1, "Steps between metric records (metrics.jsonl is always written).")
    report_to: str = opt("tensorboard", "Metric sink besides metrics.jsonl.", ("tensorboard", "wandb", "none"))
    wandb_project: str = opt("sage-grpo", "Weights & Biases project (with --report_to wandb).")
    run_name: str = opt("", "Run name for the metric sinks; empty = the output_dir name.")
    verbose: bool = opt(False, "Show the libraries' warnings and the per-denoising-step bars of rollouts and "
                               "validation (hidden by default: the step bar with its live numbers, or one line per "
                               "log_interval when not on a terminal, is what a run shows).")
    threads: int = opt(0, "torch CPU threads per process (intra-op); 0 = torch's default (all cores). On a shared CPU "
                          "machine 1-2 avoids oversubscription; also the environment variable OMP_NUM_THREADS.")
    peak_tflops: float = opt(0.0, "Peak dense TFLOP/s of one device that MFU is computed against (perf/*_mfu, the log "
                                  "line's MFU). 0 = the device's dense bf16 peak from the table in sage_grpo/flops.py "
                                  "(H100, H200, A100, L40S, RTX 4090, ...) for --dtype bf16 or fp16; on the CPU, an "
                                  "unknown device or fp32 compute: TFLOP/s only, no MFU.")


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "kl": KLConfig,
    "optim": OptimConfig,
    "validation": ValidationConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass
class Config:
    """The whole resolved configuration, one attribute per group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ---------------------------------------------------------------------------------------------- value coercion


def check_fp8_matmul_flags(fp8_base: bool, fp8_matmul: bool, dtype: str) -> None:
    """--fp8_matmul's rules for post_train.py and generate.py alike: it runs the layers of an FP8 base, as torchao's
    per-row FP8 products, which take bf16 (the device is checked by sage_grpo.models.fp8.check_fp8_matmul)."""
    if fp8_matmul and not fp8_base:
        raise SageGRPOError("--fp8_matmul runs the layers of an FP8 base; add --fp8_base")
    if fp8_matmul and torch_dtype(dtype) != torch.bfloat16:
        raise SageGRPOError(f"--fp8_matmul computes in bf16 (torchao's per-row FP8 products); use --dtype bf16, not "
                            f"{dtype}")


def parse_bool(value: Any, name: str = "value") -> bool:
    """True/False/1/0/yes/no/on/off (any case) -> bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SageGRPOError(f"{name}: {value!r} is not a boolean; use True/False, 1/0, yes/no or on/off")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' (the config's dtype names) or a torch dtype -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in TORCH_DTYPES:
        raise SageGRPOError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return TORCH_DTYPES[name]


def parse_size(value: str, name: str = "size") -> tuple[int, int]:
    """'480x864' (or 480X864) -> (480, 864): the one parser of every HxW size flag; `name` is the flag the error
    names. Whether the sides fit the model (multiples of 16) is `check_values`' rule."""
    match = re.fullmatch(r"(\d+)[xX](\d+)", str(value).strip())
    if not match:
        raise SageGRPOError(f"{name} must be HxW (HEIGHTxWIDTH in pixels, e.g. 480x864), got {value!r}")
    return int(match.group(1)), int(match.group(2))


def _field_types() -> dict[str, tuple[str, dataclasses.Field, Any]]:
    """flag name -> (group, dataclass field, resolved type)."""
    out: dict[str, tuple[str, dataclasses.Field, Any]] = {}
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in out:
                raise RuntimeError(f"flag {f.name} is defined in two groups")  # a bug in this file, not a user error
            out[f.name] = (group, f, hints[f.name])
    return out


FIELDS = _field_types()


def _coerce(name: str, value: Any) -> Any:
    """Convert a YAML or CLI value to the field's type, failing with a message naming the key."""
    _, f, tp = FIELDS[name]
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", ""))):
        return None
    choices = f.metadata.get("choices")
    try:
        if tp is bool:
            out: Any = parse_bool(value, f"--{name}")
        elif tp is int:
            if isinstance(value, bool):
                raise ValueError
            try:
                out = int(value)
            except ValueError:  # "1e3" is fine; "1.5e0" and "1e-3" are not whole numbers
                f = float(value)
                if not (math.isfinite(f) and f.is_integer()):
                    raise
                out = int(f)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
        elif tp is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
        elif typing.get_origin(tp) is list:
            if isinstance(value, str):  # one YAML scalar = one item ("a cat" is a prompt, not two)
                value = [value]
            if not isinstance(value, list | tuple):
                raise ValueError
            out = [str(v) for v in value]
        else:
            if isinstance(value, bool):  # YAML reads a bare no/off/yes as a boolean: the user meant text
                raise SageGRPOError(f"--{name}: got the YAML boolean {value}; quote the text, e.g. \"{value}\"")
            if isinstance(value, dict):  # e.g. reward_weights written as a YAML mapping
                value = json.dumps(value)
            if isinstance(value, list):
                raise ValueError
            out = "" if value is None else str(value)
    except (ValueError, TypeError, OverflowError):
        kind = getattr(tp, "__name__", str(tp))
        raise SageGRPOError(f"--{name}: {value!r} is not a valid {kind}") from None
    if choices and out not in choices:
        raise SageGRPOError(f"--{name}: {out!r} is not allowed; choose one of: {', '.join(map(str, choices))}")
    return out


# ---------------------------------------------------------------------------------------------- dict / YAML


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Grouped plain dict (the YAML layout)."""
    return {group: dataclasses.asdict(getattr(cfg, group)) for group in GROUPS}


def _unknown(key: str, known: list[str], where: str) -> SageGRPOError:
    close = difflib.get_close_matches(key, known, n=3)
    if close:
        hint = f"; did you mean {', '.join(close)}?"
    elif len(known) > 25:
        hint = "; run with --help to list the flags"
    else:
        hint = f"; known keys: {', '.join(sorted(known))}"
    return SageGRPOError(f"unknown {where} {key!r}{hint}")


def _apply(cfg: Config, values: dict[str, Any]) -> None:
    """Set flat flag values on cfg (coerced)."""
    for name, value in values.items():
        if name not in FIELDS:
            raise _unknown(name, list(FIELDS), "key")
        group = FIELDS[name][0]
        setattr(getattr(cfg, group), name, _coerce(name, value))


def _flatten_yaml(data: Any, source: str) -> dict[str, Any]:
    """Grouped YAML mapping -> flat {flag: value}; a flag may also appear at top level."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SageGRPOError(f"{source}: the top level must be a mapping of groups ({', '.join(GROUPS)})")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in GROUPS:
            if not isinstance(value, dict):
                raise SageGRPOError(f"{source}: section {key!r} must be a mapping of keys to values")
            for name, v in value.items():
                if name not in FIELDS or FIELDS[name][0] != key:
                    allowed = [f.name for f in dataclasses.fields(GROUPS[key])]
                    raise _unknown(name, allowed, f"key in section {key!r} of {source}:")
                flat[name] = v
        elif key in FIELDS:
            flat[key] = value
        else:
            raise _unknown(key, list(GROUPS) + list(FIELDS), f"section or key in {source}:")
    return flat


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Defaults updated with a grouped (or flat) dict."""
    cfg = Config()
    _apply(cfg, _flatten_yaml(data, source))
    return cfg


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Load a YAML config file as a flat {flag: value} dict."""
    p = Path(path)
    if not p.is_file():
        raise SageGRPOError(f"--config: file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SageGRPOError(f"--config: {p} is not valid YAML: {e}") from None
    return _flatten_yaml(data, str(p))


def dump_yaml(cfg: Config, path: str | Path | None = None) -> str:
    """The resolved config as grouped YAML (written to `path` when given)."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False, width=120)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return text


# ---------------------------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    """argparse that raises SageGRPOError (one clear message, close-match hints) instead of exiting."""

    def error(self, message: str) -> typing.NoReturn:
        if "unrecognized arguments" in message:
            bad = [a for a in message.split(":", 1)[1].split() if a.startswith("--")]
            if bad:
                raise _unknown(bad[0][2:].split("=")[0], list(FIELDS), "flag")
        raise SageGRPOError(message)


def build_parser(prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """A parser with `--config` and one flag per config field (defaults shown, values coerced later)."""
    parser = _Parser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="YAML config file (grouped sections); CLI flags override it.")
    defaults = config_to_dict(Config())
    for group, cls in GROUPS.items():
        g = parser.add_argument_group(group, (cls.__doc__ or "").strip())
        for f in dataclasses.fields(cls):
            tp = FIELDS[f.name][2]
            default = defaults[group][f.name]
            choices = f.metadata.get("choices")
            help_text = f.metadata["help"] + (f" Choices: {', '.join(map(str, choices))}." if choices else "")
            help_text += f" (default: {default!r})"
            kwargs: dict[str, Any] = {"help": help_text.replace("%", "%%"), "dest": f.name}
            if tp is bool:
                kwargs.update(nargs="?", const="true", metavar="BOOL")
            elif typing.get_origin(tp) is list:
                kwargs.update(nargs="*", metavar="ITEM")
            else:
                kwargs.update(metavar=f.name.upper())
            g.add_argument(f"--{f.name}", **kwargs)
    # ArgumentDefaultsHelpFormatter would print "==SUPPRESS==": the default is already in the help text. The
    # description keeps its lines (a script's docstring: examples one per line)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def load_config(argv: list[str] | None = None, *, prog: str | None = None, description: str | None = None) -> Config:
    """defaults < `--config` YAML < CLI flags -> Config (not yet validated against a world size)."""
    parser = build_parser(prog=prog, description=description)
    args = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    cfg = Config()
    path = args.pop("config", None)
    from_yaml = read_yaml(path) if path else {}
    # A named recipe sets its keys under the explicit settings of its own level and above: `--recipe` lies between
    # the YAML file and the flags, a `recipe:` key of the file under the file's other keys. Its keys count as given
    # where the recipe was (a --recipe flag on a resume overrides the run's settings as the flags it stands for do).
    on_cli = "recipe" in args
    recipe = _coerce("recipe", args["recipe"] if on_cli else from_yaml.get("recipe", ""))
    steps = _coerce("grpo_sampling_steps", args.get("grpo_sampling_steps", from_yaml.get(
        "grpo_sampling_steps", cfg.rollout.grpo_sampling_steps)))
    from_recipe = recipe_settings(recipe, steps) if recipe else {}
    for layer in ((from_yaml, from_recipe) if on_cli else (from_recipe, from_yaml)):
        _apply(cfg, layer)
    _apply(cfg, args)
    # the keys the user set (YAML or flag): defaults read from the checkpoint (post_train.py) never override them
    cfg.explicit = frozenset(from_yaml) | frozenset(from_recipe) | frozenset(args)
    cfg.command_line = frozenset(args) | (frozenset(from_recipe) if on_cli else frozenset())
    # what the user gave, kept apart from cfg, which a resume turns into the saved run's settings (resume_settings)
    cfg.given = {name: copy.deepcopy(_value(cfg, name)) for name in cfg.explicit}
    check_values(cfg)
    return cfg


def _value(cfg: Config, name: str) -> Any:
    return getattr(getattr(cfg, FIELDS[name][0]), name)


# this launch's values on a resume, never the saved run's: where the run is, what this launch does with it, and how
# it is spread over the GPUs (the parallel group; a checkpoint continues on any valid layout and none of it changes
# what is trained)
LAUNCH_KEYS = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir",
               *(f.name for f in dataclasses.fields(ParallelConfig)))


def resume_settings(cfg: Config, saved: dict[str, dict[str, Any]]
                    ) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
    """Make `cfg` (from load_config) the settings of a resumed run, in place: the saved run's config (config_to_dict
    layout, the checkpoint's train state) is the base and the flags given on the command line override it. The
    `--config` file's values do not: the run took them when it started, under that launch's flags, so
    `--config tiny.yaml --sde_type flow_grpo` resumed with `--config tiny.yaml` keeps flow_grpo; to change a setting
    on a resume, pass its flag. LAUNCH_KEYS are always this launch's; a key the checkpoint predates keeps this
    launch's value. The same result however often it is called (it reads what the user gave from `cfg.given`); a
    Config not from load_config counts as given on the command line, every key of it.
    -> (overridden: {"group.key": (saved, flag)} where a flag changes the run, kept: {"group.key": (saved, file)}
    where the --config file's value differs from the run's and was not applied)."""
    if not hasattr(cfg, "given"):
        cfg.given = {name: copy.deepcopy(_value(cfg, name)) for name in FIELDS}
        cfg.command_line = cfg.explicit = frozenset(FIELDS)
    overridden, kept = {}, {}
    for group, values in saved.items():
        for name, old in values.items():
            if name in LAUNCH_KEYS or FIELDS.get(name, (None,))[0] != group:  # a flag this version no longer has
                continue
            old = _coerce(name, old)
            new = cfg.given.get(name, old)
            if name in cfg.command_line:
                if new != old:
                    overridden[f"{group}.{name}"] = (old, new)
                setattr(getattr(cfg, group), name, copy.deepcopy(new))
                continue
            if new != old:
                kept[f"{group}.{name}"] = (old, new)
            setattr(getattr(cfg, group), name, old)
    # the saved run resolved these already: the model's own defaults (post_train.resolve_checkpoint_defaults) apply
    # only to keys it predates
    cfg.explicit = cfg.explicit | {name for values in saved.values() for name in values if name in FIELDS}
    return overridden, kept


# ---------------------------------------------------------------------------------------------- validation


def dp_degree(cfg: Config, world_size: int) -> int:
    """Data-parallel degree = world_size / sp_size."""
    return world_size // cfg.parallel.sp_size


def check_window(r: RolloutConfig, o: OptimConfig) -> None:
    """The SDE window lies inside the schedule, every position of it has a noisy step to train, and the shared
    prefix has something to share."""
    from sage_grpo.window import window_positions

    t = r.grpo_sampling_steps
    for name in ("sde_window_start", "sde_window_size", "sde_window_stride"):
        if getattr(r, name) < 0:
            raise SageGRPOError(f"--{name} must be >= 0, got {getattr(r, name)}")
    if r.sde_window_every < 1:
        raise SageGRPOError(f"--sde_window_every must be >= 1, got {r.sde_window_every}")
    size = r.sde_window_size or t - r.sde_window_start
    if r.sde_window_start >= t or r.sde_window_start + size > t:
        raise SageGRPOError(f"the SDE window [{r.sde_window_start}, {r.sde_window_start + size}) is not inside the "
                            f"{t} steps (--grpo_sampling_steps): lower --sde_window_start or --sde_window_size")
    if r.sde_window_stride and not r.sde_window_size:
        raise SageGRPOError("a sliding window (--sde_window_stride) needs --sde_window_size (a window that reaches the "
                            "last step cannot move)")
    positions = window_positions(t, r.sde_window_start, r.sde_window_size, r.sde_window_stride)
    if r.sde_window_stride and len(positions) < 2:
        raise SageGRPOError(f"the window [{r.sde_window_start}, {r.sde_window_start + size}) cannot slide by "
                            f"{r.sde_window_stride} inside {t} steps: lower --sde_window_size or --sde_window_stride")
    where = "" if size == t else " of the SDE window"
    for lo in positions:
        noisy = size - (1 if r.sde_type == "cps" and lo + size == t else 0)  # cps's last step injects no noise
        if noisy < 1:
            raise SageGRPOError(f"the SDE window [{lo}, {lo + size}) holds only cps's last step, which injects no "
                                "noise: nothing to train; widen --sde_window_size")
        if math.floor(round(noisy * o.timestep_fraction, 9)) < 1:
            raise SageGRPOError(f"--timestep_fraction {o.timestep_fraction:g} trains int({noisy} x "
                                f"{o.timestep_fraction:g}) = 0 of the {noisy} noisy steps{where}; use at least "
                                f"{1 / noisy:.4g}")
    if r.ode_steps < 0:
        raise SageGRPOError(f"--ode_steps must be >= 0 (0 = one per schedule step), got {r.ode_steps}")
    if (r.ode_steps or r.ode_solver != "euler") and all(lo + size == t for lo in positions):
        raise SageGRPOError(f"--ode_solver {r.ode_solver} --ode_steps {r.ode_steps} act on the ODE steps after the SDE "
                            f"window, and the window [{positions[0]}, {positions[0] + size}) reaches the last of the "
                            f"{t} steps: set --sde_window_size (e.g. {max(1, t // 4)}) or drop them")
    if r.shared_prefix and not r.use_same_noise:
        raise SageGRPOError("--shared_prefix needs --use_same_noise True: without one initial noise per group the "
                            "samples of a group differ from the first step, so there is no prefix to share")
    if r.shared_prefix and r.sde_window_start < 1:
        raise SageGRPOError("--shared_prefix needs --sde_window_start >= 1: the shared prefix is the ODE steps before "
                            "the SDE window, and a window from step 0 leaves none")


def check_judge(cfg: Config) -> None:
    """The vlm_judge flags: a URL exactly when the judge is selected (trained or a validation metric), counts >= 1,
    a template file that can be read."""
    r = cfg.reward
    names = [str(n).strip().lower() for n in [*r.reward_model.split(","), *cfg.validation.validation_metrics]]
    judged = "vlm_judge" in names
    if r.judge_url.strip() and not judged:
        raise SageGRPOError("--judge_url is only used by the vlm_judge reward (in --reward_model or "
                            f"--validation_metrics), got --reward_model {r.reward_model}")
    for name, value in (("judge_frames", r.judge_frames), ("judge_concurrency", r.judge_concurrency),
                        ("judge_max_tokens", r.judge_max_tokens)):
        if value < 1:
            raise SageGRPOError(f"--{name} must be >= 1, got {value}")
    if judged:
        check_judge_url(r.judge_url)
        read_judge_template(r.judge_template)


def check_judge_url(url: str) -> str:
    """``--judge_url`` stripped; one SageGRPOError line when it is empty, several, or not http(s)."""
    url = url.strip()
    if not url:
        raise SageGRPOError("--reward_model vlm_judge needs --judge_url http://host:port (an OpenAI-compatible chat "
                            "server: vllm serve, python -m sglang.launch_server, transformers serve)")
    if "," in url:
        raise SageGRPOError(f"--judge_url takes one server, got {url!r} (put several behind a load balancer)")
    if not url.startswith(("http://", "https://")):
        raise SageGRPOError(f"--judge_url {url!r} must start with http:// or https://")
    return url


def read_judge_template(path: str) -> str | None:
    """The text of the ``--judge_template`` file, None when ``path`` is empty (the built-in template of the scale);
    one SageGRPOError line for a file that is missing, unreadable, not UTF-8 or empty."""
    if not path.strip():
        return None
    p = Path(path).expanduser()
    hint = "a UTF-8 text file with the judging prompt, {prompt} standing for the video's prompt"
    if not p.is_file():
        raise SageGRPOError(f"--judge_template {path}: no such file ({hint}; relative to the working directory "
                            f"{Path.cwd()})")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        msg = " ".join(str(err).split())
        raise SageGRPOError(f"--judge_template {path} cannot be read ({type(err).__name__}: {msg}; {hint})") from None
    if not text.strip():
        raise SageGRPOError(f"--judge_template {path} is empty ({hint})")
    return text


def check_values(cfg: Config) -> None:
    """Value checks that need no world size: ranges, sizes, frame counts, JSON."""
    r, o, v, d, k = cfg.rollout, cfg.optim, cfg.validation, cfg.data, cfg.kl
    positive = {
        "max_steps": o.max_steps,  # 0 would train nothing and leave a run folder that a next launch counts as a run
        "batch_size": d.batch_size,
        "num_generations": d.num_generations,
        "grpo_sampling_steps": r.grpo_sampling_steps,
        "sp_size": cfg.parallel.sp_size,
        "dp_replicate": cfg.parallel.dp_replicate,
        "dist_timeout_minutes": cfg.parallel.dist_timeout_minutes,
        "gradient_accumulation_steps": o.gradient_accumulation_steps,
        "mini_batch_size_per_update": o.mini_batch_size_per_update,
        "updates_per_rollout": o.updates_per_rollout,
        "update_ref_model_step": k.update_ref_model_step,
        "kl_history": k.kl_history,
        "validation_num_inference_steps": v.validation_num_inference_steps,
        "lora_r": cfg.model.lora_r,
    }
    for name, value in positive.items():
        if value < 1:
            raise SageGRPOError(f"--{name} must be >= 1, got {value}")
    if d.num_generations < 2:
        raise SageGRPOError(f"--num_generations must be >= 2 for group-relative advantages, got {d.num_generations}")
    nonneg = {
        "warmup_steps": o.warmup_steps,
        "threads": cfg.logging.threads,
        "peak_tflops": cfg.logging.peak_tflops,
        "num_workers": d.num_workers,
        "save_interval": cfg.checkpoint.save_interval,
        "validation_interval": v.validation_interval,
        "checkpoints_total_limit": cfg.checkpoint.checkpoints_total_limit,
        "kl_warmup_updates": k.kl_warmup_updates,
        "reward_batch_size": cfg.reward.reward_batch_size,
        "max_failed_reward_steps": cfg.reward.max_failed_reward_steps,
        "reward_retries": cfg.reward.reward_retries,
        "reward_min_pixels": cfg.reward.reward_min_pixels,
        "eta": r.eta,
        "kl_weight": k.kl_weight,
        "kl_coef": k.kl_coef,
        "kl_min_coef": k.kl_min_coef,
        "learning_rate": o.learning_rate,
        "weight_decay": o.weight_decay,
    }
    for name, value in nonneg.items():
        if value < 0:
            raise SageGRPOError(f"--{name} must be >= 0, got {value}")
    if not 0.0 < o.timestep_fraction <= 1.0:
        raise SageGRPOError(f"--timestep_fraction must be in (0, 1], got {o.timestep_fraction}")
    check_window(r, o)
    for name, value in (("adam_beta1", o.adam_beta1), ("adam_beta2", o.adam_beta2)):
        if not 0.0 <= value < 1.0:
            raise SageGRPOError(f"--{name} must be in [0, 1), got {value}")
    if o.adam_eps <= 0:
        raise SageGRPOError(f"--adam_eps must be > 0, got {o.adam_eps}")
    if o.clip_range <= 0:
        raise SageGRPOError(f"--clip_range must be > 0, got {o.clip_range}")
    if o.adv_clip_max <= 0:
        raise SageGRPOError("--adv_clip_max must be > 0 (advantages are clamped to +-adv_clip_max), got "
                            f"{o.adv_clip_max}")
    for name, value in (("video_fps", r.video_fps), ("log_interval", cfg.logging.log_interval)):
        if value < 1:
            raise SageGRPOError(f"--{name} must be >= 1, got {value}")
    remote = any(n.strip().lower() == "remote" for n in cfg.reward.reward_model.split(","))
    if remote and not cfg.reward.reward_url.strip():
        raise SageGRPOError("--reward_model remote needs --reward_url http://host:port (a server started with "
                            "scripts/serve_reward.py)")
    if cfg.reward.reward_url.strip() and not remote:
        raise SageGRPOError(f"--reward_url is only used by --reward_model remote, got --reward_model "
                            f"{cfg.reward.reward_model}")
    for url in cfg.reward.reward_url.split(","):
        if url.strip() and not url.strip().startswith(("http://", "https://")):
            raise SageGRPOError(f"--reward_url {url.strip()!r} must start with http:// or https://")
    if cfg.reward.reward_timeout <= 0:
        raise SageGRPOError(f"--reward_timeout must be > 0 seconds, got {cfg.reward.reward_timeout}")
    check_judge(cfg)
    if cfg.reward.reward_sample_fps <= 0:
        raise SageGRPOError(f"--reward_sample_fps must be > 0, got {cfg.reward.reward_sample_fps}")
    if cfg.reward.reward_min_pixels > cfg.reward.reward_max_pixels:
        raise SageGRPOError(
            f"--reward_min_pixels ({cfg.reward.reward_min_pixels}) must be <= --reward_max_pixels "
            f"({cfg.reward.reward_max_pixels})"
        )
    for name, value in (("hacking_reward_rise", v.hacking_reward_rise), ("hacking_metric_drop", v.hacking_metric_drop)):
        if value <= 0:
            raise SageGRPOError(f"--{name} must be > 0 (a change in spreads of the metric), got {value:g}")
    if r.flow_shift <= 0 or v.validation_timestep_shift <= 0:
        raise SageGRPOError("--flow_shift and --validation_timestep_shift must be > 0")
    if not 0.0 < r.sage_sigma_clamp < 1.0:
        raise SageGRPOError(f"--sage_sigma_clamp must be in (0, 1), got {r.sage_sigma_clamp}")
    if r.eta == 0:  # every rollout sampler is an SDE (sde_type has no "ode")
        raise SageGRPOError(
            f"--eta must be > 0 for --sde_type {r.sde_type}: at eta = 0 every step is the deterministic ODE, every "
            "log-prob is 0 and nothing learns; use the paper's 0.5"
        )
    if r.sde_type == "sage_grpo":  # every step must inject noise (--grpo_sampling_steps / --flow_shift / clamp)
        check_sage_schedule(r.grpo_sampling_steps, r.flow_shift, r.sage_sigma_clamp)
    if r.sde_type == "cps" and r.eta > 1.0:
        raise SageGRPOError(f"--eta must be <= 1 for cps (s_t = sigma_next sin(eta pi/2) <= sigma_next), got {r.eta}")
    if k.kl_weight > 0 and not k.kl_min_coef <= k.kl_coef <= k.kl_weight:
        raise SageGRPOError(
            f"need --kl_min_coef ({k.kl_min_coef}) <= --kl_coef ({k.kl_coef}) <= --kl_weight ({k.kl_weight}): "
            "the coefficient starts at kl_coef and stays within [kl_min_coef, kl_weight]"
        )
    if k.kl_target is not None and k.kl_target < 0:
        raise SageGRPOError(f"--kl_target must be >= 0 (or none = kl_weight), got {k.kl_target}")
    for name, frames in (("sample_n_frames", r.sample_n_frames), ("validate_video_length", v.validate_video_length)):
        if frames < 1 or (frames - 1) % 4 != 0:
            lo = max(1, 4 * ((frames - 1) // 4) + 1)
            raise SageGRPOError(
                f"--{name} must be 4k + 1 (the VAE compresses time 4x), got {frames}; use {lo} or {lo + 4}"
            )
    vh, vw = parse_size(v.validation_fixed_size, "--validation_fixed_size")
    for name, px in (("height", r.height), ("width", r.width), ("validation_fixed_size height", vh),
                     ("validation_fixed_size width", vw)):
        if px < 16 or px % 16 != 0:
            near = max(16, 16 * round(px / 16))
            raise SageGRPOError(f"--{name} must be a positive multiple of 16 (VAE 16x and patch size), got {px}; try "
                                f"{near}")
    try:
        weights = json.loads(cfg.reward.reward_weights or "{}")  # "" = each reward's own default weights
        if not isinstance(weights, dict) or not all(isinstance(x, int | float) for x in weights.values()):
            raise ValueError
    except (ValueError, TypeError):
        raise SageGRPOError(
            f"--reward_weights must be a JSON object of numbers like '{{\"VQ\":0.5,\"MQ\":0.5,\"TA\":1.0}}', "
            f"got {cfg.reward.reward_weights!r}"
        ) from None
    if d.batch_size % o.mini_batch_size_per_update:
        raise SageGRPOError(f"--mini_batch_size_per_update {o.mini_batch_size_per_update} must divide --batch_size "
                            f"{d.batch_size} (the rollout and the update run the rank's videos in those chunks)")
    chunks = d.batch_size // o.mini_batch_size_per_update
    if chunks % o.updates_per_rollout:
        raise SageGRPOError(f"--updates_per_rollout {o.updates_per_rollout} must divide batch_size / "
                            f"mini_batch_size_per_update = {chunks} (each update takes whole micro-batches)")
    accum = o.gradient_accumulation_steps
    if o.updates_per_rollout > 1 and accum > 1:
        raise SageGRPOError("--updates_per_rollout > 1 and --gradient_accumulation_steps > 1 cannot be combined; "
                            "set one of them to 1")
    for name, value in (("max_steps", o.max_steps), ("save_interval", cfg.checkpoint.save_interval)):
        if value % accum:
            raise SageGRPOError(f"--{name} {value} must be a multiple of --gradient_accumulation_steps {accum} "
                                "(checkpoints and the end of training fall on optimizer updates)")
    if cfg.checkpoint.resume_from_checkpoint and not cfg.checkpoint.output_dir:
        raise SageGRPOError("--resume_from_checkpoint needs --output_dir")


def validate(cfg: Config, world_size: int, num_heads: int = 16, *, training: bool = True) -> None:
    """All checks, including the distributed batch geometry for `world_size` processes and `num_heads` heads, and
    flag combinations that would be silently ignored. `training`: the config is about to train (post_train.py,
    scripts/bench_step.py), so a prompt file is required; scripts/plan_memory.py plans a config without one."""
    check_values(cfg)
    sp, bs, g = cfg.parallel.sp_size, cfg.data.batch_size, cfg.data.num_generations
    if world_size % sp != 0:
        divisors = [x for x in range(1, world_size + 1) if world_size % x == 0]
        raise SageGRPOError(
            f"--sp_size {sp} must divide the world size {world_size}; use one of {divisors}"
        )
    if num_heads % sp != 0:
        ok = [x for x in range(1, num_heads + 1) if num_heads % x == 0]
        raise SageGRPOError(f"--sp_size {sp} must divide the attention head count {num_heads}; use one of {ok}")
    if cfg.model.use_lora and cfg.model.lora_dropout > 0:
        raise SageGRPOError(f"--lora_dropout {cfg.model.lora_dropout:g}: the rollout samples with the deterministic "
                            "policy (no dropout) and the update would re-score with dropout, so the ratio leaves 1 "
                            "and the clip silently zeroes those pairs (and sequence-parallel ranks would drop "
                            "different text tokens); use --lora_dropout 0")
    m = cfg.model
    if m.fp8_base and not m.use_lora:
        raise SageGRPOError("--fp8_base quantizes the frozen base of a LoRA run; add --use_lora (full fine-tuning "
                            "trains every weight in --master_weight_type)")
    check_fp8_matmul_flags(m.fp8_base, m.fp8_matmul, m.dtype)
    dp = dp_degree(cfg, world_size)
    if (bs * dp) % g != 0:
        raise SageGRPOError(
            f"batch_size * dp_degree = {bs} * {dp} = {bs * dp} videos per step is not a multiple of "
            f"--num_generations {g}; change --batch_size, --num_generations or --sp_size so that "
            f"(batch_size * world_size / sp_size) % num_generations == 0"
        )
    if dp % cfg.parallel.dp_replicate != 0:
        raise SageGRPOError(
            f"--dp_replicate {cfg.parallel.dp_replicate} must divide dp_degree = world_size / sp_size = {dp}"
        )
    p = cfg.parallel
    if p.dp_replicate > 1 and not (p.enable_fsdp and world_size > 1):
        raise SageGRPOError(f"--dp_replicate {p.dp_replicate} (HSDP) needs --enable_fsdp under torchrun; without "
                            "FSDP2 every rank holds the whole model anyway: use --dp_replicate 1")
    if cfg.model.compile and world_size > 1 and (p.enable_fsdp or sp > 1):
        # compile_blocks runs before fully_shard, as torchtitan orders it, and the Ulysses collectives are traceable,
        # but neither combination has been run compiled: refused rather than left to fail inside a job
        raise SageGRPOError(f"--compile is not yet verified with {'FSDP2' if p.enable_fsdp else ''}"
                            f"{' and ' if p.enable_fsdp and sp > 1 else ''}{f'--sp_size {sp}' if sp > 1 else ''} "
                            "under torchrun; use --compile False, or --enable_fsdp False --sp_size 1 (replicated "
                            "weights)")
    if training and not cfg.data.train_video_csv:
        raise SageGRPOError("--train_video_csv is required: a prompt file (.csv with a `prompt` column, .txt or "
                            ".jsonl)")
