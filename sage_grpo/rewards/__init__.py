"""Rewards: protocol, registry, weighted composite, VideoAlign, CLIPScore/PickScore, closed-form demo rewards, the
synthetic world's detector rewards, reward servers and a VLM judge over an OpenAI-compatible endpoint.

The training loop calls :func:`build_reward` once and then ``reward(videos, prompts)`` on decoded videos
float [B, F, 3, H, W] in [0, 1]; the result holds ``"total"`` (weighted sum) and every component, NaN where a score
failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from sage_grpo.config import REWARD_MAX_PIXELS, REWARD_SAMPLE_FPS, VIDEO_FPS
from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards import builtin, clip_metrics, judge, remote, videoalign, world  # noqa: F401 - registers them
from sage_grpo.rewards.base import (
    CompositeReward,
    Reward,
    check_first_call,
    get_reward_builder,
    is_import_path,
    parse_reward_weights,
    register_reward,
    reward_key,
    reward_names,
    score_safely,
)

# Setting A (averaged) and Setting B (alignment-focused, the authors' default) of the paper's Table 2
SETTING_A = '{"VQ":1.0,"MQ":1.0,"TA":1.0}'
SETTING_B = '{"VQ":0.5,"MQ":0.5,"TA":1.0}'

__all__ = [
    "SETTING_A",
    "SETTING_B",
    "CompositeReward",
    "Reward",
    "build_reward",
    "build_reward_from_config",
    "missing_reward_files",
    "check_first_call",
    "is_import_path",
    "get_reward_builder",
    "parse_reward_weights",
    "register_reward",
    "reward_key",
    "reward_names",
    "score_safely",
]


def build_reward(
    reward_model: str = "videoalign_local",
    reward_model_path: str | Path = "",
    reward_base_model_path: str | Path = "",
    reward_weights: str | Mapping[str, float] | None = SETTING_B,
    reward_checkpoint_mode: str = "v3",
    pretrained_model_root: str | Path = "ckpts",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "bf16",
    max_pixels: int = REWARD_MAX_PIXELS,
    sample_fps: float = REWARD_SAMPLE_FPS,
    video_fps: float = VIDEO_FPS,
    batch_size: int = 0,
    reward_optional: str = "",
    **extra: object,
) -> CompositeReward:
    """Build the (composite) reward the training loop calls.

    ``reward_model``: one registered name or several joined by commas (``"videoalign_local,clipscore"``); an import
    path ``package.module:factory`` or ``path/to/file.py:factory`` names a user's factory, called with the same
    keyword arguments as the built-in builders.
    ``reward_weights``: JSON like ``'{"VQ":0.5,"MQ":0.5,"TA":1.0}'`` (keys case-insensitive, any component of the
    selected rewards); ``None`` or ``""`` = each reward's default weights. ``reward_optional``: components, joined by
    commas, whose failure does not mask a video in training. Paths default to
    ``<pretrained_model_root>/VideoReward`` and ``<pretrained_model_root>/Qwen2-VL-2B-Instruct``. ``extra`` goes to
    every builder (e.g. ``clip_model_path``, ``min_pixels``, ``color_target``, ``attn_implementation``).
    """
    names = [n.strip() for n in str(reward_model).split(",") if n.strip()]
    if not names:
        get_reward_builder("")  # raises with the list of valid names
    builders = {reward_key(n): get_reward_builder(n) for n in names}
    kwargs = dict(
        reward_model_path=reward_model_path,
        reward_base_model_path=reward_base_model_path,
        reward_checkpoint_mode=reward_checkpoint_mode,
        pretrained_model_root=pretrained_model_root,
        device=device,
        dtype=dtype,
        max_pixels=max_pixels,
        sample_fps=sample_fps,
        video_fps=video_fps,
        batch_size=batch_size,
        **extra,
    )
    rewards = {n: b(**kwargs) for n, b in builders.items()}
    components = [c for r in rewards.values() for c in r.components]
    weights = parse_reward_weights(reward_weights, components)
    optional = [o.strip() for o in reward_optional.split(",") if o.strip()]
    return CompositeReward(rewards, weights, optional)


def build_reward_from_config(cfg, device: str | torch.device = "cpu") -> CompositeReward:
    """`build_reward` with every setting taken from a resolved `sage_grpo.config.Config` (the one source of
    defaults): the reward group, the model root and the video frame rate."""
    return build_reward(**_config_kwargs(cfg, device))


def missing_reward_files(cfg, names) -> list[str]:
    """What the rewards `names` would not find on disk with `cfg`'s paths, one message each, without loading a
    model: each builder's optional ``check_files(**kwargs) -> list[str]`` (the keyword arguments `build_reward`
    gives it). The preflight's, so that every missing file is said in one round."""
    kwargs = _config_kwargs(cfg, "cpu")
    for k in ("reward_model", "reward_weights", "reward_optional"):
        kwargs.pop(k)
    problems: list[str] = []
    for name in dict.fromkeys(reward_key(n) for n in names if n.strip()):
        try:
            check = getattr(get_reward_builder(name), "check_files", None)
        except SageGRPOError:
            continue  # an unknown name: the caller's get_reward_builder says so
        if check is not None:
            problems += [p for p in check(**kwargs) if p not in problems]
    return problems


def _config_kwargs(cfg, device: str | torch.device) -> dict:
    r = cfg.reward
    return dict(
        reward_model=r.reward_model,
        reward_model_path=r.reward_model_path,
        reward_base_model_path=r.reward_base_model_path,
        reward_weights=r.reward_weights,
        reward_optional=r.reward_optional,
        reward_checkpoint_mode=r.reward_checkpoint_mode,
        pretrained_model_root=cfg.model.pretrained_model_root,
        device=device,
        dtype=r.reward_dtype,
        max_pixels=r.reward_max_pixels,
        sample_fps=r.reward_sample_fps,
        video_fps=cfg.rollout.video_fps,
        batch_size=r.reward_batch_size,
        reward_checkpoint_step=None if r.reward_checkpoint_step < 0 else r.reward_checkpoint_step,
        min_pixels=r.reward_min_pixels,
        clip_model_path=r.clip_model_path,
        pickscore_model_path=r.pickscore_model_path,
        pickscore_processor_path=r.pickscore_processor_path,
        reward_url=r.reward_url,
        reward_timeout=r.reward_timeout,
        reward_retries=r.reward_retries,
        judge_url=r.judge_url,
        judge_model=r.judge_model,
        judge_template=r.judge_template,
        judge_scale=r.judge_scale,
        judge_frames=r.judge_frames,
        judge_video=r.judge_video,
        judge_concurrency=r.judge_concurrency,
        judge_allow_http_key=r.judge_allow_http_key,
        judge_max_tokens=r.judge_max_tokens,
    )
