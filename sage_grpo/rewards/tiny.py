"""Tiny random VideoReward checkpoint + tiny "Qwen2-VL-2B-Instruct" base, in the authors' on-disk layouts; and a
tiny VLM judge that `transformers serve` serves (`write_tiny_judge`: a fixed answer; `write_tiny_frame_judge`: a
judge of the frames' brightness or contrast).

Used by tests, the benchmark and the embedded CPU demo so that they run the real loading, key remapping, LoRA
merging, tokenisation and pooling code without any download. Sizes: a 2-layer vision tower and a 2-layer language
model of width 32, a byte-level tokenizer (256 bytes + Qwen's special tokens + the 3 reward tokens); a few
hundred kB on disk, built in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sage_grpo.config import REWARD_MAX_PIXELS, REWARD_SAMPLE_FPS
from sage_grpo.rewards.videoalign_ckpt import DEFAULT_NORM, PEFT_PREFIX, SPECIAL_TOKENS, remap_v2

# Qwen2-VL's special tokens in their real order (ids 151643.. in the real vocabulary, 256.. here)
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
TINY_VOCAB_PAD = 18  # base embedding rows beyond the tokenizer (the real base has 151,936 rows for 151,657 tokens)
LORA_R, LORA_ALPHA = 4, 8  # same alpha / r = 2 as the real r 64, alpha 128
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_byte_tokenizer(extra_special: tuple[str, ...] = (), n_merges: int = 2000):
    """A byte-level BPE Qwen2Tokenizer + Qwen specials (+ ``extra_special``), merges learnt in-process.

    The merges are trained (deterministically) on the VideoAlign query template and the chat text so that the
    ~2.9k-character query becomes a few hundred tokens, keeping tiny-model scoring fast on CPU.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    from sage_grpo.rewards.videoalign import CHAT_PREFIX, CHAT_SUFFIX, DETAILED_SPECIAL_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if n_merges > 0:
        text = CHAT_PREFIX + CHAT_SUFFIX + DETAILED_SPECIAL_TEMPLATE
        for t in (*QWEN_SPECIALS, *SPECIAL_TOKENS, "{text}", "{text_prompt}"):  # same merges for base and reward
            text = text.replace(t, " ")
        trainer = trainers.BpeTrainer(
            vocab_size=len(alphabet) + n_merges, initial_alphabet=alphabet, show_progress=False, min_frequency=1
        )
        tok.train_from_iterator([text], trainer=trainer)
    else:
        tok.model = models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[])
    tok.add_special_tokens(list(QWEN_SPECIALS) + list(extra_special))
    return Qwen2Tokenizer(
        tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def tiny_base_config(tokenizer) -> dict:
    """config.json of the tiny base in the hub's (transformers 4.4x) format."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},  # sums to head_dim / 2 = 4
        "tie_word_embeddings": True,
        "vocab_size": len(tokenizer) + TINY_VOCAB_PAD,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "torch_dtype": "float32",
        "vision_config": {
            "depth": 2, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2, "in_chans": 3, "hidden_size": 32,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
    }  # fmt: skip


def _to_hub_layout(key: str) -> str:
    """Our internal key (model.visual.*, model.language_model.*) -> the hub's 4.4x file key."""
    if key.startswith("model.visual."):
        return key[len("model.") :]
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model.") :]
    return key


def write_tiny_base(out: str | Path, seed: int = 0) -> Path:
    """Write config.json, tokenizer files, preprocessor_config.json and model.safetensors (hub layout) to ``out``."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLModel

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer()
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(tiny_base_config(tok), indent=2))
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 12845056,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2VLProcessor",
            },  # fmt: skip
            indent=2,
        )
    )
    torch.manual_seed(seed)
    cfg = Qwen2VLConfig.from_pretrained(str(out))
    model = Qwen2VLModel._from_config(cfg, attn_implementation="sdpa")
    state = {_to_hub_layout("model." + k): v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    return out


def _peft_state(base_state: dict[str, torch.Tensor], n_vocab: int, gen: torch.Generator) -> tuple[dict, dict, dict]:
    """(full PEFT state, LoRA-only adapter state, non-LoRA trained state), all in the current key layout.

    ``base_state`` uses our internal keys. "Training" = new rows for the 3 reward tokens, perturbed embeddings and
    vision merger, a random rm_head and LoRA pairs with non-zero B on every language-model linear layer.
    """

    def rnd(*shape: int, scale: float = 0.05) -> torch.Tensor:
        """Seeded normal tensor."""
        return torch.randn(*shape, generator=gen) * scale

    emb = base_state["model.language_model.embed_tokens.weight"]
    emb = torch.cat([emb[: n_vocab - len(SPECIAL_TOKENS)], rnd(len(SPECIAL_TOKENS), emb.shape[1], scale=0.5)])
    emb = emb + rnd(*emb.shape, scale=0.01)  # [n_vocab, D]
    trained = {"model.language_model.embed_tokens.weight": emb, "rm_head.weight": rnd(1, emb.shape[1], scale=0.5)}
    for k, v in base_state.items():
        if k.startswith("model.visual.merger."):
            trained[k] = v + rnd(*v.shape, scale=0.02)
    full: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for k, v in base_state.items():
        mod = k.rsplit(".", 1)[0]
        if k.startswith("model.language_model.layers.") and mod.split(".")[-1] in LORA_TARGETS:
            leaf = k.rsplit(".", 1)[1]
            full[f"{mod}.base_layer.{leaf}"] = v
            if leaf == "weight":
                a, b = rnd(LORA_R, v.shape[1], scale=0.3), rnd(v.shape[0], LORA_R, scale=0.3)
                full[f"{mod}.lora_A.default.weight"], full[f"{mod}.lora_B.default.weight"] = a, b
                adapter[f"{mod}.lora_A.weight"], adapter[f"{mod}.lora_B.weight"] = a, b
        else:
            full[k] = trained.get(k, v)
    full["rm_head.weight"] = trained["rm_head.weight"]
    full["lm_head.weight"] = emb  # tied, as in the real PEFT model's state dict
    return full, adapter, trained


def write_tiny_videoreward(
    out: str | Path, base_dir: str | Path, layout: str = "old", steps: tuple[int, ...] = (2, 8), seed: int = 1
) -> Path:
    """Write model_config.json and checkpoint-<step>/ dirs (model.pth + adapter + non-LoRA + tokenizer) to ``out``.

    ``layout`` "old" writes the transformers-4.4x keys of the published checkpoint, "new" the current ones. Every
    step gets different random training weights, so loading the wrong step is detectable.
    """
    from safetensors.torch import load_file, save_file

    out, base_dir = Path(out), Path(base_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer(SPECIAL_TOKENS)
    n_vocab = len(tok)
    hub = load_file(str(base_dir / "model.safetensors"))
    base_state = {}
    for k, v in hub.items():  # hub layout -> internal
        base_state["model." + k if k.startswith("visual.") else "model.language_model." + k[len("model.") :]] = v
    config = {
        "data_config": {
            "meta_data": "", "data_dir": "", "fps": REWARD_SAMPLE_FPS, "num_frames": None,
            "max_frame_pixels": REWARD_MAX_PIXELS,
            "eval_dim": ["VQ", "MQ", "TA"], "prompt_template_type": "detailed_special", "sample_type": "uniform",
        },
        "model_config": {
            "model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct", "output_dim": 1, "use_special_tokens": True,
            "reward_token": "special", "torch_dtype": "bfloat16",
        },
        "peft_lora_config": {
            "lora_enable": True, "lora_r": LORA_R, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.05,
            "lora_namespan_exclude": ["lm_head", "rm_head", "embed_tokens", "visual"], "use_rslora": False,
            "lora_task_type": "CAUSAL_LM",
        },
        "inference_config": {f"{k}_{s}": v
                             for k, (m, sd) in DEFAULT_NORM.items() for s, v in (("mean", m), ("std", sd))},
    }  # fmt: skip
    (out / "model_config.json").write_text(json.dumps(config, indent=2))
    for i, step in enumerate(steps):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        full, adapter, trained = _peft_state(base_state, n_vocab, gen)

        def key(k: str) -> str:
            """Internal key -> PEFT key in the requested layout."""
            pk = PEFT_PREFIX + k
            return remap_v2(pk) if layout == "old" else pk

        d = out / f"checkpoint-{step}"
        d.mkdir(exist_ok=True)
        torch.save({key(k): v.contiguous() for k, v in full.items()}, d / "model.pth")
        save_file({key(k): v.contiguous() for k, v in adapter.items()}, str(d / "adapter_model.safetensors"))
        torch.save({key(k): v.contiguous() for k, v in trained.items()}, d / "non_lora_state_dict.pth")
        (d / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": LORA_R, "lora_alpha": LORA_ALPHA, "use_rslora": False,
                        "target_modules": list(LORA_TARGETS), "base_model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct"})
        )  # fmt: skip
        tok.save_pretrained(str(d))
    return out


# ------------------------------------------------------------------------------------------------ a tiny VLM judge

JUDGE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


JUDGE_SIDE, JUDGE_PATCH = 28, 14  # the judges' image side and patch: 2 x 2 patches (+ the class token, dropped)
LUMA = (0.299, 0.587, 0.114)  # BT.601, as the `brightness` reward


def _tiny_llava(seed: int, patch: int = JUDGE_PATCH, heads: int = 4):
    """(random tiny LLaVA, its processor, its byte tokenizer): a CLIP vision tower of 28-pixel images in patches of
    ``patch`` pixels, a Qwen2 language model of width 32 with ``heads`` attention heads (1: head size 32, the
    smallest vLLM's CPU attention takes), the byte tokenizer (digits one token each) with an ``<image>`` token, a
    PIL image processor and a ChatML chat template."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    tok = build_byte_tokenizer(("<image>",), n_merges=0)
    side = JUDGE_SIDE
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
        tokenizer=tok, patch_size=patch, vision_feature_select_strategy="default", chat_template=JUDGE_CHAT_TEMPLATE,
        image_token="<image>", num_additional_image_tokens=1,
    )
    ids = tok.convert_tokens_to_ids
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=side, patch_size=patch).to_dict(),
        text_config=Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                                num_key_value_heads=max(1, heads // 2), vocab_size=len(tok),
                                max_position_embeddings=4096, eos_token_id=ids("<|im_end|>"),
                                tie_word_embeddings=False).to_dict(),
        image_token_index=ids("<image>"), image_seq_length=(side // patch) ** 2, vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(cfg).eval(), processor, tok


def _silence(lm) -> None:
    """Set a Qwen2 language model's layers to write nothing (attention and MLP outputs 0) and to attend uniformly
    (query and key projections 0), for the hand-set judges to write only what they set."""
    for layer in lm.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight.zero_()
            proj.bias.zero_()
        attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def _save_judge(model, processor, tok, out: Path) -> Path:
    """Greedy generation config, then the model and processor in the layout of the hub's LLaVA checkpoints
    (llava-hf), which ``transformers serve`` and vLLM load: transformers 5 writes the CLIP tower's weights as
    ``vision_tower.embeddings...``, the hub's checkpoints (and vLLM 0.32, which loads no other) name them
    ``vision_tower.vision_model.embeddings...``; transformers reads either."""
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False)
    processor.save_pretrained(out)
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    tower, hub = "vision_tower.", "vision_tower.vision_model."
    state = {hub + k[len(tower):] if k.startswith(tower) and not k.startswith(hub) else k: v
             for k, v in load_file(weights).items()}
    save_file(state, weights, metadata={"format": "pt"})
    return out


def write_tiny_judge(out: str | Path, answer: str = "7", seed: int = 0) -> Path:
    """A tiny LLaVA (`_tiny_llava`) in the layout ``transformers serve`` loads, whose greedy answer to any chat is
    ``answer`` (one byte) and then the end of the turn.

    Its vision tower and projector are random and run on every image, but the language model is set so that the
    answer does not depend on them: value projections of weight 0 and bias b make every attention output the same
    vector, which writes a constant along dimension 0 of the residual stream (the MLPs write nothing); the
    embedding of ``answer`` alone has a component along dimension 1. The head reads ``answer`` from dimension 0
    and the end of turn from dimension 1 (twice as strongly), so any token but ``answer`` is followed by
    ``answer``, and ``answer`` by the end of turn.
    """
    out = Path(out)
    model, processor, tok = _tiny_llava(seed)
    ids = tok.convert_tokens_to_ids
    eos, said = ids("<|im_end|>"), ids(answer)
    lm, big = model.model.language_model, 100.0
    with torch.no_grad():
        lm.embed_tokens.weight[:, :2] = 0
        lm.embed_tokens.weight[said, 1] = big
        for layer in lm.layers:
            attn = layer.self_attn
            attn.v_proj.weight.zero_()
            attn.v_proj.bias.zero_()
            attn.v_proj.bias[0] = big / len(lm.layers)
            attn.o_proj.weight.zero_()
            attn.o_proj.weight[0, 0] = 1.0
            layer.mlp.down_proj.weight.zero_()
        lm.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[said, 0] = 1.0
        model.lm_head.weight[eos, 1] = 2.0
    return _save_judge(model, processor, tok, out)


FRAME_JUDGE_READS = ("brightness", "contrast")
FRAME_JUDGE_RANGE = {"brightness": (0.2, 0.8), "contrast": (0.02, 0.2)}  # default (lo, hi) of each property
FRAME_JUDGE_PATCH = {"brightness": 14, "contrast": 7}  # 2 x 2 or 4 x 4 patches an image
CONTRAST_SHARPNESS = 0.851 * 20  # soft |d| = d tanh(17 d): |d| within 1% from d = 0.15, quadratic below ~0.05


def soft_abs(d: torch.Tensor) -> torch.Tensor:
    """d tanh(CONTRAST_SHARPNESS d): what the contrast judge's CLIP MLP computes (QuickGELU(z) + QuickGELU(-z) =
    z tanh(0.851 z))."""
    return d * torch.tanh(CONTRAST_SHARPNESS * d)


def frame_judge_property(patch_luma: torch.Tensor, reads: str, lo: float, hi: float) -> torch.Tensor:
    """The number `write_tiny_frame_judge` computes from the mean lumas float [images, patches] of the patches of
    one chat's images (as the CLIP processor resized them, its normalisation undone), in the language model's units:

    * brightness: the mean over all patches of 4 x / sqrt(1 + x^2), x = (luma - (lo + hi) / 2) * 2 / (hi - lo);
    * contrast: the mean over all patches of `soft_abs` (luma - the mean luma of its image's patches).
    """
    luma = patch_luma.double()
    if reads == "brightness":
        x = (luma - (lo + hi) / 2) * 2 / (hi - lo)
        return (4 * x / torch.sqrt(1 + x * x)).mean()
    return soft_abs(luma - luma.mean(dim=-1, keepdim=True)).mean()


def frame_judge_centres(reads: str, lo: float, hi: float) -> torch.Tensor:
    """float64 [9]: the property (`frame_judge_property`) at which the judge answers 1, ..., 9 exactly: brightness:
    that of uniform images of mean luma evenly spaced from ``lo`` to ``hi``; contrast: evenly spaced from ``lo`` to
    ``hi``."""
    levels = torch.linspace(lo, hi, 9, dtype=torch.float64)
    if reads == "brightness":
        return torch.stack([frame_judge_property(v.view(1, 1), reads, lo, hi) for v in levels])
    return levels


def frame_judge_digit(patch_luma: torch.Tensor, reads: str, lo: float, hi: float) -> int:
    """The digit `write_tiny_frame_judge` answers (to rounding): the centre nearest the chat's property."""
    m = frame_judge_property(patch_luma, reads, lo, hi)
    return int((frame_judge_centres(reads, lo, hi) - m).abs().argmin()) + 1


def write_tiny_frame_judge(out: str | Path, reads: str = "contrast", lo: float | None = None,
                           hi: float | None = None, seed: int = 0) -> Path:
    """A tiny LLaVA (`_tiny_llava`) whose greedy answer is a digit 1..9 (then the end of the turn) that rises with a
    property of the images, whatever the text of the chat: the centre (`frame_judge_centres`) nearest the property
    (`frame_judge_property`, 1 at ``lo`` or below, 9 at ``hi`` or above; defaults `FRAME_JUDGE_RANGE`). ``reads``:

    * "brightness": the patches' mean BT.601 luma (2 x 2 patches of 14 pixels an image);
    * "contrast": how far the patches' lumas stand from their image's mean (4 x 4 patches of 7 pixels): 0 for a
      plain image, and for one object on a plain background it grows with the object's area (up to half the frame)
      and with its contrast to the background.

    The weights are set by hand (all others 0; LayerNorm and RMSNorm weights 1, biases 0):

    * vision tower: the patch embedding writes x = the patch's luma less a constant (its weights undo the
      processor's per-channel normalisation; the position embedding adds the constant) as [x, -x, C, -C] on
      dimensions 0..3, so that CLIP's pre-LayerNorm keeps the pair's ratio: brightness: C = 1 and scaled so that
      dimension 0 becomes 4 x / sqrt(1 + x^2), dimension 2 4 / sqrt(1 + x^2) (the same norm for every patch); the
      encoder layers write nothing. Contrast: C = 10, so the pre-LayerNorm is a near-constant scale r = 4 / sqrt(x^2
      + 100) (within 0.25%); layer 0's queries and keys are 0, so attention averages the image's patches (the class
      token carries 0) and writes -mean, +mean onto dimensions 4, 5; its MLP's two hidden units G (x r - mean) and
      -G (x r - mean) add up through QuickGELU to z tanh(0.851 z), written (/ G) onto dimension 6: `soft_abs` of
      the patch's luma less its image's mean;
    * projector: linear_1 shifts the feature (and brightness' 4 / sqrt(1 + x^2)) by +10, where GELU is the
      identity to 1e-9, and linear_2 shifts back: each image token enters the language model as [feature, 1,
      4 / sqrt(1 + x^2)] (brightness, norm sqrt(17)) or [feature, 1, 30] (contrast, norm within 1.5e-4 of 30): the
      language model's RMSNorms scale every image token alike;
    * language model: every token but the images' is 0 there; layer 0's queries and keys are 0, so attention is
      uniform over the positions before, and its values and output projection write (sum of features, number of
      image tokens) / positions onto dimensions 4 and 5 of the last position (the MLPs and layer 1 write nothing).
      The head reads digit k as 2 t_k * dim4 + (20 - t_k^2) * dim5, proportional to 20 + m^2 - (m - t_k)^2 with m
      the mean feature and t_k the centre of k: the nearest centre wins whatever the number of text tokens and the
      final RMSNorm's scale. The digits' embeddings carry a large dimension 6 that the head reads as the end of
      turn, so a digit is followed by the end of turn.
    """
    if reads not in FRAME_JUDGE_READS:
        raise ValueError(f"reads must be one of {FRAME_JUDGE_READS}, got {reads!r}")
    lo = FRAME_JUDGE_RANGE[reads][0] if lo is None else lo
    hi = FRAME_JUDGE_RANGE[reads][1] if hi is None else hi
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"need 0 <= lo < hi <= 1, got lo={lo}, hi={hi}")
    out = Path(out)
    patch = FRAME_JUDGE_PATCH[reads]
    model, processor, tok = _tiny_llava(seed, patch)
    ids = tok.convert_tokens_to_ids
    eos, digits = ids("<|im_end|>"), [ids(str(k)) for k in range(1, 10)]
    ip = processor.image_processor
    vision = model.model.vision_tower
    vision = getattr(vision, "vision_model", vision)  # transformers 5 flattened CLIPVisionModel
    proj, lm = model.model.multi_modal_projector, model.model.language_model
    brightness = reads == "brightness"
    # x = scale (luma - centre): brightness 1 at hi, -1 at lo; contrast luma - 0.5
    scale, centre, const = (2 / (hi - lo), (lo + hi) / 2, 1.0) if brightness else (1.0, 0.5, 10.0)
    shift, gain = 10.0, 50.0  # gain r = 20: CONTRAST_SHARPNESS
    with torch.no_grad():
        for name, w in vision.named_parameters():
            if not name.endswith(("layer_norm1.weight", "layer_norm2.weight", "pre_layrnorm.weight",
                                  "post_layernorm.weight")):
                w.zero_()
            else:
                w.fill_(1.0)
        emb = vision.embeddings
        for ch, (w, std) in enumerate(zip(LUMA, ip.image_std)):
            # pixel_values = (v - mean) / std: the sum over a patch of w std pixel_values / area = luma - sum w mean
            emb.patch_embedding.weight[0, ch] = scale * w * std / patch**2
            emb.patch_embedding.weight[1, ch] = -scale * w * std / patch**2
        offset = scale * (sum(w * m for w, m in zip(LUMA, ip.image_mean)) - centre)
        emb.position_embedding.weight[1:, :4] = torch.tensor([offset, -offset, const, -const])
        emb.position_embedding.weight[0, 2:4] = torch.tensor([const, -const])  # the class token: x = 0
        p1, p2 = proj.linear_1, proj.linear_2
        for lin in (p1, p2):
            lin.weight.zero_()
            lin.bias.zero_()
        if brightness:  # the pre-LayerNorm's [4s, -4s, 4c, -4c] -> [4s, 1, 4c]
            p1.weight[0, 0] = p1.weight[2, 2] = 1.0
            p1.bias[[0, 2]] = shift
            p2.weight[0, 0] = p2.weight[2, 2] = 1.0
            p2.bias[:3] = torch.tensor([-shift, 1.0, -shift])
        else:
            layer = vision.encoder.layers[0]
            n = (JUDGE_SIDE // patch) ** 2
            layer.self_attn.v_proj.weight[0, 0] = (n + 1) / n  # the mean over the patches (the class token adds 0)
            layer.self_attn.out_proj.weight[4, 0], layer.self_attn.out_proj.weight[5, 0] = -1.0, 1.0
            fc1, fc2 = layer.mlp.fc1, layer.mlp.fc2
            fc1.weight[0, [0, 1, 4, 5]] = torch.tensor([gain / 2, -gain / 2, gain / 2, -gain / 2])
            fc1.weight[1] = -fc1.weight[0]
            fc2.weight[6, :2] = 1.0 / (gain * 0.4)  # z = gain r (luma - mean) with r = 0.4 (within 0.13%)
            # projector: [soft |d|, 1, 30]
            p1.weight[0, 6] = 1.0
            p1.bias[0] = shift
            p2.weight[0, 0] = 1.0
            p2.bias[:3] = torch.tensor([-shift, 1.0, 30.0])
        # language model: uniform attention averages (feature, 1) of the image tokens onto dimensions 4 and 5
        lm.embed_tokens.weight.zero_()
        lm.embed_tokens.weight[digits, 6] = 100.0
        _silence(lm)
        for layer in lm.layers:
            layer.input_layernorm.weight.fill_(1.0)
        attn = lm.layers[0].self_attn
        attn.v_proj.weight[0, 0] = attn.v_proj.weight[1, 1] = 1.0  # kv head 0, read by query heads 0, 1
        attn.o_proj.weight[4, 0] = attn.o_proj.weight[5, 1] = 1.0  # query head 0's output
        lm.norm.weight.fill_(1.0)
        t = frame_judge_centres(reads, lo, hi)
        head = model.lm_head.weight
        head.zero_()
        head[digits, 4] = (4.0 * 2 * t).float()
        head[digits, 5] = (4.0 * (20.0 - t * t)).float()  # 20 > the largest m^2 (16): the best digit's logit > 0
        head[eos, 6] = 1000.0
    return _save_judge(model, processor, tok, out)


TEN_MARKER = "#"  # the byte whose share of the context sets P(10) of the ten judge


def write_tiny_ten_judge(out: str | Path, seed: int = 0) -> Path:
    """A tiny LLaVA (`_tiny_llava`, the byte tokenizer: 10 is written "1" then "0", as Qwen2/2.5 write it) that
    answers 9 or 10, P(10) rising with the share of the byte `TEN_MARKER` in the chat (about 0.0004 with none, 0.5
    at 17 in 80 bytes of prompt, 0.98 at 30), so the judge's reading of a two-token 10 can be checked through a real
    server against the model's own distribution.

    Language model: the query and key projections are 0, so attention is uniform over the context; layer 0's
    value projection writes a constant (its bias) along dimension 0 and the context's mean of embedding dimension 2,
    which only the marker has, along dimension 2; nothing else writes. The head scores "9" from dimension 0 and "1"
    from dimension 0 (a little less) plus dimension 2: the gap, linear in the marker's share, sets P("1"). "1" has
    its own embedding dimension 3, from which the head reads "0"; "0" and "9" have dimension 1, from which it reads
    the end of the turn. So the answer is "9" or "1" "0", then the end. The vision tower runs on every image and the
    image tokens count in the average, but nothing of them is read."""
    out = Path(out)
    model, processor, tok = _tiny_llava(seed, heads=1)  # head size 32: vLLM serves it
    ids = tok.convert_tokens_to_ids
    eos, one, zero, nine, mark = ids("<|im_end|>"), ids("1"), ids("0"), ids("9"), ids(TEN_MARKER)
    lm, big = model.model.language_model, 100.0
    with torch.no_grad():
        emb = lm.embed_tokens.weight
        emb[:, :4] = 0
        emb[[zero, nine], 1] = big  # "0" and "9": the end follows
        emb[mark, 2] = big  # the marker, averaged over the context
        emb[one, 3] = big  # "1": "0" follows
        _silence(lm)
        attn = lm.layers[0].self_attn  # one head: its value dims 0 and 1 are written
        attn.v_proj.bias[0] = 1.0
        attn.v_proj.weight[1, 2] = 1.0
        attn.o_proj.weight[0, 0] = big
        attn.o_proj.weight[2, 1] = big
        lm.norm.weight.fill_(1.0)
        proj = model.model.multi_modal_projector.linear_2  # image tokens write nothing the head or layer 0 reads
        proj.weight[:4] = 0
        proj.bias[:4] = 0
        head = model.lm_head.weight
        head.zero_()
        head[nine, 0] = 20.0
        head[one, 0] = 20.0 - 1.4  # with the weight 2 on dimension 2 below: P("1") from ~0 (no marker) to ~1
        head[one, 2] = 2.0
        head[zero, 3] = 40.0
        head[eos, 1] = 40.0
    return _save_judge(model, processor, tok, out)
