"""Tiny random VideoReward checkpoint + tiny "Qwen2-VL-2B-Instruct" base, in the authors' on-disk layouts; and a
tiny VLM judge that `transformers serve` serves (`write_tiny_judge`).

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


def write_tiny_judge(out: str | Path, answer: str = "7", seed: int = 0) -> Path:
    """A tiny LLaVA (CLIP vision tower of 28-pixel images, Qwen2 language model of width 32, the byte tokenizer
    with an ``<image>`` token, a PIL image processor and a ChatML chat template) in the layout ``transformers
    serve`` loads, whose greedy answer to any chat is ``answer`` (one byte) and then the end of the turn.

    Its vision tower and projector are random and run on every image, but the language model is set so that the
    answer does not depend on them: value projections of weight 0 and bias b make every attention output the same
    vector, which writes a constant along dimension 0 of the residual stream (the MLPs write nothing); the
    embedding of ``answer`` alone has a component along dimension 1. The head reads ``answer`` from dimension 0
    and the end of turn from dimension 1 (twice as strongly), so any token but ``answer`` is followed by
    ``answer``, and ``answer`` by the end of turn.
    """
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    out = Path(out)
    tok = build_byte_tokenizer(("<image>",), n_merges=0)
    side, patch = 28, 14  # 2 x 2 patches + the class token, which the "default" feature strategy drops
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
        tokenizer=tok, patch_size=patch, vision_feature_select_strategy="default", chat_template=JUDGE_CHAT_TEMPLATE,
        image_token="<image>", num_additional_image_tokens=1,
    )
    processor.save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    eos, said = ids("<|im_end|>"), ids(answer)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=side, patch_size=patch).to_dict(),
        text_config=Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096,
                                eos_token_id=eos, tie_word_embeddings=False).to_dict(),
        image_token_index=ids("<image>"), image_seq_length=(side // patch) ** 2, vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
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
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(out)
    return out
