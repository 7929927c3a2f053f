"""VideoAlign (VideoReward) scoring of decoded frames, in memory and batched.

Equivalent to the authors' ``VideoVLMRewardInference.reward`` on an mp4 written at 24 fps, without the mp4: frames
sampled at 2 fps, resized to multiples of 28 within ``max_pixels``, Qwen2-VL chat text with the "detailed_special"
template whose three special tokens ``<|VQ_reward|> <|MQ_reward|> <|TA_reward|>`` are read by ``rm_head``.

Positions are the plain 1-D running index (what the official forward gets, because it calls the language model
with ``inputs_embeds`` and no ``input_ids``); handing ``input_ids`` + ``video_grid_thw`` to the transformers-5
multimodal model would switch to 3-D M-RoPE positions and change every score.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch

from sage_grpo.config import REWARD_MAX_PIXELS, REWARD_MIN_PIXELS, REWARD_SAMPLE_FPS, VIDEO_FPS, torch_dtype
from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards.base import register_reward
from sage_grpo.rewards.video_preprocess import MERGE_SIZE, pixels_from_read, preprocess_videos
from sage_grpo.rewards.videoalign_ckpt import (
    DEFAULT_NORM,
    SPECIAL_TOKENS,
    VideoRewardNet,
    assemble_state_dict,
    find_checkpoint,
    load_state_strict,
)

# VideoAlign's prompt_template.py, template type "detailed_special" (text reproduced exactly, incl. the two
# trailing spaces after some headings: they are tokens the reward model was trained with)
DETAILED_SPECIAL_TEMPLATE = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""  # noqa: W291, E501 - the authors' prompt, verbatim (trailing spaces and long lines are what the model was trained with)

# Qwen2-VL's chat template for one user turn holding [video, text], with add_generation_prompt=True
CHAT_PREFIX = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
VIDEO_PAD = "<|video_pad|>"
CHAT_SUFFIX = "<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"


def build_prompt(prompt: str) -> str:
    """The "detailed_special" query text for one generation prompt."""
    return DETAILED_SPECIAL_TEMPLATE.format(text_prompt=prompt)


def chat_text(prompt: str, n_video_tokens: int) -> str:
    """The full chat string the processor would produce, with the video placeholder expanded (for tests/docs)."""
    return CHAT_PREFIX + VIDEO_PAD * n_video_tokens + CHAT_SUFFIX.format(text=build_prompt(prompt))


def pick_attn_implementation(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """ "auto" -> flash_attention_2 when flash-attn is importable on a CUDA half-precision model, else sdpa."""
    if requested != "auto":
        return requested
    fa_ok = importlib.util.find_spec("flash_attn") is not None
    if fa_ok and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return "flash_attention_2"
    return "sdpa"


class VideoAlignReward:
    """VideoReward scores of decoded videos: VQ, MQ, TA (normalised), Overall = their sum, and the raw values.

    ``videos`` float [B, F, 3, H, W] in [0, 1], ``F`` frames at ``video_fps``. Every output is a float32 [B].
    """

    components = ("VQ", "MQ", "TA", "Overall", "VQ_raw", "MQ_raw", "TA_raw")
    default_weights = {"VQ": 0.5, "MQ": 0.5, "TA": 1.0}  # Setting B of the paper, the authors' default

    def __init__(
        self,
        model_path: str | Path,
        base_model_path: str | Path,
        checkpoint_mode: str = "v3",
        checkpoint_step: int | None = None,
        weights_form: str = "auto",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        max_pixels: int = REWARD_MAX_PIXELS,
        min_pixels: int = REWARD_MIN_PIXELS,
        sample_fps: float = REWARD_SAMPLE_FPS,
        video_fps: float = VIDEO_FPS,
        batch_size: int = 0,
        attn_implementation: str = "auto",
        quantize: bool = True,
    ):
        """Load the checkpoint (see ``videoalign_ckpt``) onto ``device`` in ``dtype``; nothing is downloaded."""
        from transformers import AutoTokenizer, Qwen2VLConfig

        self.device = torch.device(device)
        self.dtype = dtype
        self.max_pixels, self.min_pixels = int(max_pixels), int(min(min_pixels, max_pixels))
        self.sample_fps, self.video_fps = float(sample_fps), float(video_fps)
        self.batch_size = int(batch_size)
        self.quantize = quantize
        files = find_checkpoint(model_path, checkpoint_step, weights_form)
        self.files = files
        base = Path(base_model_path)
        problem = _base_model_problem(base)
        if problem:
            raise SageGRPOError(problem)
        tok_dir = files.checkpoint_dir if (files.checkpoint_dir / "tokenizer_config.json").is_file() else base
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
        except Exception as err:  # noqa: BLE001
            raise SageGRPOError(f"cannot load the reward tokenizer from {tok_dir}: {err}") from None
        if any(self.tokenizer.convert_tokens_to_ids(t) in (None, self.tokenizer.unk_token_id) for t in SPECIAL_TOKENS):
            self.tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
        self.special_ids = [self.tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
        self.video_pad_id = self.tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

        config = Qwen2VLConfig.from_pretrained(str(base))
        if config.video_token_id != self.video_pad_id:
            raise SageGRPOError(
                f"base config video_token_id {config.video_token_id} != tokenizer id of {VIDEO_PAD} "
                f"{self.video_pad_id}: --reward_base_model_path and the checkpoint's tokenizer do not belong together"
            )
        # the reward model's embeddings were resized to the tokenizer (151,660 rows for the real one)
        config.text_config.vocab_size = len(self.tokenizer)
        config.vocab_size = len(self.tokenizer)
        mcfg = files.config.get("model_config") or {}
        output_dim = int(mcfg.get("output_dim", 1))
        if output_dim not in (1, 3):
            raise SageGRPOError(f"model_config.output_dim must be 1 or 3 for VQ/MQ/TA special tokens, got {output_dim}")
        state = assemble_state_dict(files, base, checkpoint_mode)
        attn = pick_attn_implementation(attn_implementation, self.device, dtype)
        net = VideoRewardNet(config, output_dim, attn)
        load_state_strict(net, state, checkpoint_mode)
        self.net = net.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.attn_implementation = attn

        inf = files.config.get("inference_config") or {}
        stats = [(float(inf.get(f"{k}_mean", m)), float(inf.get(f"{k}_std", s))) for k, (m, s) in DEFAULT_NORM.items()]
        self.norm_mean = torch.tensor([m for m, _ in stats], device=self.device)  # [3] VQ, MQ, TA
        self.norm_std = torch.tensor([s for _, s in stats], device=self.device)  # [3]
        self._prefix_ids = self._encode(CHAT_PREFIX)

    # ------------------------------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS additions."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def build_input_ids(
        self, prompts: Sequence[str], n_video_tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids`` and ``attention_mask`` [B, L] with each video placeholder expanded.

        Tokenised piecewise (prefix, N x <|video_pad|>, suffix): special tokens split the text before BPE anyway,
        so this equals tokenising the whole expanded string, without running BPE over thousands of placeholders.
        """
        rows = []
        for p, n in zip(prompts, n_video_tokens, strict=True):
            suffix = self._encode(CHAT_SUFFIX.format(text=build_prompt(p)))
            rows.append(self._prefix_ids + [self.video_pad_id] * int(n) + suffix)
        L = max(len(r) for r in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return ids.to(self.device), mask.to(self.device)

    @property
    def read_spec(self) -> dict:
        """What it reads of a video (`sage_grpo.rewards.remote.apply_read`): the frames at ``sample_fps``, resized;
        a reward server of it receives only those."""
        size = {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "quantize": self.quantize}
        return {"frames": {"sample_fps": self.sample_fps, "video_fps": self.video_fps}, "size": size}

    @torch.no_grad()
    def raw_scores(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Un-normalised (VQ, MQ, TA) of one batch: videos [B, F, 3, H, W] -> float32 [B, 3]."""
        videos = videos.to(self.device)
        pixels, grid = preprocess_videos(
            videos, self.video_fps, self.sample_fps, self.min_pixels, self.max_pixels, self.quantize
        )  # [B*t*h*w, 1176], [B, 3]
        return self._raw(pixels, grid, prompts)

    @torch.no_grad()
    def raw_scores_read(self, x: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """`raw_scores` of what `read_spec` reads: [B, n, 3, h, w] in [0, 255] -> float32 [B, 3]."""
        pixels, grid = pixels_from_read(x.to(self.device).float())
        return self._raw(pixels, grid, prompts)

    def _raw(self, pixels: torch.Tensor, grid: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """The model on preprocessed pixels [B*t*h*w, 1176] with grids [B, 3] -> float32 [B, 3]."""
        n_tokens = (grid.prod(-1) // MERGE_SIZE**2).tolist()  # merged tokens per video
        ids, mask = self.build_input_ids(prompts, n_tokens)  # [B, L]
        lm = self.net.model.language_model
        embeds = lm.embed_tokens(ids)  # [B, L, D]
        feats = self.net.model.visual(pixels.to(self.dtype), grid_thw=grid).pooler_output  # [sum(n_tokens), D]
        vmask = (ids == self.video_pad_id).unsqueeze(-1).expand_as(embeds)  # [B, L, D]
        embeds = embeds.masked_scatter(vmask, feats.to(embeds.dtype))
        # plain 1-D positions (running index of the mask; equal to arange on the unpadded part with right padding)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        hidden = lm(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).last_hidden_state  # [B, L, D]
        logits = self.net.rm_head(hidden).float()  # [B, L, out]
        rows = []
        for tid in self.special_ids:
            hit = ids == tid  # [B, L]
            if not bool((hit.sum(-1) == 1).all()):
                raise RuntimeError("each query must contain every reward token exactly once (prompt contains one?)")
            rows.append(logits[hit])  # [B, out]
        pooled = torch.stack(rows, dim=1)  # [B, 3, out]
        if pooled.shape[-1] == 3:
            return pooled.diagonal(dim1=1, dim2=2)  # [B, 3]: head k read at token k
        return pooled[..., 0]  # [B, 3]

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {VQ, MQ, TA, Overall, VQ_raw, MQ_raw, TA_raw: float32 [B]} on the input device."""
        return self._scores(self.raw_scores, videos, prompts)

    def score_read(self, x: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """`__call__` on what `read_spec` reads ([B, n, 3, h, w] in [0, 255]): what a reward server calls."""
        return self._scores(self.raw_scores_read, x, prompts)

    def _scores(self, raw_fn, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        B = videos.shape[0]
        if len(prompts) != B:
            raise ValueError(f"{B} videos but {len(prompts)} prompts")
        bs = self.batch_size if self.batch_size > 0 else B
        raw = torch.cat([raw_fn(videos[i : i + bs], prompts[i : i + bs]) for i in range(0, B, bs)])
        norm = (raw - self.norm_mean) / self.norm_std  # [B, 3]
        out = {"VQ": norm[:, 0], "MQ": norm[:, 1], "TA": norm[:, 2], "Overall": norm.sum(-1)}
        out.update({"VQ_raw": raw[:, 0], "MQ_raw": raw[:, 1], "TA_raw": raw[:, 2]})
        return {k: v.to(videos.device) for k, v in out.items()}


def _base_model_problem(base: Path) -> str:
    if (base / "config.json").is_file():
        return ""
    return (f"no config.json in the reward base model directory {base}: download Qwen/Qwen2-VL-2B-Instruct "
            "there (hf download Qwen/Qwen2-VL-2B-Instruct --local-dir ...) or set --reward_base_model_path")


def check_videoalign_files(reward_model_path: str | Path = "", reward_base_model_path: str | Path = "",
                           pretrained_model_root: str | Path = "ckpts", reward_checkpoint_step: int | None = None,
                           **_: object) -> list[str]:
    """The preflight's look at the files `build_videoalign` would load (nothing is read but the directory listing
    and model_config.json): what is missing, one message each, the VideoReward checkpoint and its base model."""
    root = Path(pretrained_model_root)
    problems = []
    try:
        find_checkpoint(reward_model_path or root / "VideoReward", reward_checkpoint_step)
    except SageGRPOError as e:
        problems.append(str(e))
    problem = _base_model_problem(Path(reward_base_model_path or root / "Qwen2-VL-2B-Instruct"))
    return problems + ([problem] if problem else [])


@register_reward("videoalign_local")
def build_videoalign(
    reward_model_path: str | Path = "",
    reward_base_model_path: str | Path = "",
    pretrained_model_root: str | Path = "ckpts",
    reward_checkpoint_mode: str = "v3",
    reward_checkpoint_step: int | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "bf16",
    max_pixels: int = REWARD_MAX_PIXELS,
    min_pixels: int = REWARD_MIN_PIXELS,
    sample_fps: float = REWARD_SAMPLE_FPS,
    video_fps: float = VIDEO_FPS,
    batch_size: int = 0,
    attn_implementation: str = "auto",
    **_: object,
) -> VideoAlignReward:
    """Builder: empty paths default to <pretrained_model_root>/VideoReward and .../Qwen2-VL-2B-Instruct."""
    root = Path(pretrained_model_root)
    return VideoAlignReward(
        model_path=reward_model_path or root / "VideoReward",
        base_model_path=reward_base_model_path or root / "Qwen2-VL-2B-Instruct",
        checkpoint_mode=reward_checkpoint_mode,
        checkpoint_step=reward_checkpoint_step,
        device=device,
        dtype=torch_dtype(dtype),
        max_pixels=max_pixels,
        min_pixels=min_pixels,
        sample_fps=sample_fps,
        video_fps=video_fps,
        batch_size=batch_size,
        attn_implementation=attn_implementation,
    )


build_videoalign.check_files = check_videoalign_files  # post_train.py's preflight asks it
