"""Loading the authors' VideoReward checkpoint layout into a transformers-5 Qwen2-VL + ``rm_head``.

Layout (``KlingTeam/VideoReward``)::

    VideoReward/model_config.json              data_config, model_config, peft_lora_config, inference_config
    VideoReward/checkpoint-<step>/model.pth    full PEFT-wrapped state dict (LoRA unmerged), or
    VideoReward/checkpoint-<step>/adapter_model.safetensors + non_lora_state_dict.pth   (LoRA-only save)
    VideoReward/checkpoint-<step>/tokenizer*.json   Qwen2-VL tokenizer + <|VQ_reward|> <|MQ_reward|> <|TA_reward|>

The base model (config, tokenizer and, for the LoRA-only form, weights) comes from a local
Qwen2-VL-2B-Instruct directory: nothing is fetched. Keys are remapped (modes v1/v2/v3, below) into the
transformers-5 layout and LoRA is merged exactly (``W + scale * B @ A``) so that no peft is needed at run time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from sage_grpo.errors import SageGRPOError

SPECIAL_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
PEFT_PREFIX = "base_model.model."
# statistics of the authors' inference_config (docs/rewards.md, VideoAlign), used when the file has none
DEFAULT_NORM = {"VQ": (3.6757, 2.2476), "MQ": (1.1646, 1.3811), "TA": (2.8105, 2.5121)}

# ----------------------------------------------------------------------------------------------------------------
# Key remapping. Layouts of the PEFT-wrapped model's keys:
#   transformers 4.4x (the published checkpoint): base_model.model.visual.*, base_model.model.model.{embed_tokens,
#       layers,norm}.*, base_model.model.lm_head.*, base_model.model.rm_head.*
#   transformers >= 4.5x / 5 ("current"):       base_model.model.model.visual.*, base_model.model.model.language_model.*
# The authors' modes (reward_checkpoint_mode): v1 = 4.4x -> current; v2 = current -> 4.4x (for running on an old
# transformers); v3 = every known variant (incl. vision_tower aliases) -> current. Our model always has the current
# layout, so after v2 we apply the 4.4x -> current step as well: every mode loads either published layout.
# ----------------------------------------------------------------------------------------------------------------

_OLD_LM = re.compile(r"^base_model\.model\.model\.(embed_tokens|layers|norm)\b")


def remap_v1(key: str) -> str:
    """transformers-4.4x key -> current layout (keys already current pass through)."""
    if key.startswith("base_model.model.visual."):
        return "base_model.model.model.visual." + key[len("base_model.model.visual.") :]
    if _OLD_LM.match(key):
        return "base_model.model.model.language_model." + key[len("base_model.model.model.") :]
    return key


def remap_v2(key: str) -> str:
    """Current-layout key -> transformers-4.4x layout (the authors' v2)."""
    if key.startswith("base_model.model.model.visual."):
        return "base_model.model.visual." + key[len("base_model.model.model.visual.") :]
    if key.startswith("base_model.model.model.language_model."):
        return "base_model.model.model." + key[len("base_model.model.model.language_model.") :]
    return key


def remap_v3(key: str) -> str:
    """Any known variant (4.4x, current, ``vision_tower`` / top-level ``language_model`` aliases) -> current."""
    for old, new in (
        ("base_model.model.visual.", "base_model.model.model.visual."),
        ("base_model.model.vision_tower.", "base_model.model.model.visual."),
        ("base_model.model.model.vision_tower.", "base_model.model.model.visual."),
        ("base_model.model.language_model.", "base_model.model.model.language_model."),
    ):
        if key.startswith(old):
            key = new + key[len(old) :]
            break
    if _OLD_LM.match(key):
        key = "base_model.model.model.language_model." + key[len("base_model.model.model.") :]
    return key


REMAP_MODES = {"v1": remap_v1, "v2": lambda k: remap_v1(remap_v2(k)), "v3": remap_v3}


def remap_keys(state: Mapping[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """Apply remap ``mode`` (v1 | v2 | v3) to every key; the result is in the current layout."""
    if mode not in REMAP_MODES:
        raise SageGRPOError(f"unknown --reward_checkpoint_mode {mode!r}; valid: {', '.join(REMAP_MODES)}")
    fn = REMAP_MODES[mode]
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        nk = fn(k)
        if nk in out:
            raise SageGRPOError(f"checkpoint has two tensors for {nk!r} after remapping with mode {mode}")
        out[nk] = v
    return out


# ----------------------------------------------------------------------------------------------------------------
# LoRA merge
# ----------------------------------------------------------------------------------------------------------------

_LORA = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])(?:\.(?P<name>[A-Za-z0-9_]+))?\.weight$")


def merge_lora(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Fold LoRA pairs into their base weights: ``W = W0 + scale * B @ A`` (computed in float32).

    Accepts peft's key forms ``<mod>.lora_A[.default].weight`` with the base at ``<mod>.base_layer.weight`` (full
    save) or ``<mod>.weight`` (base model weights + adapter). Returns a state dict without any LoRA keys.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        m = _LORA.match(k)
        if m:
            pairs.setdefault(m["mod"], {})[m["ab"]] = v
        elif ".base_layer." in k:
            out[k.replace(".base_layer.", ".")] = v
        else:
            out[k] = v
    for mod, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise SageGRPOError(f"LoRA weights of {mod} are incomplete (have {sorted(ab)}, need A and B)")
        wkey = mod + ".weight"
        if wkey not in out:
            raise SageGRPOError(f"LoRA adapter for {mod} has no base weight {wkey} (base model weights missing?)")
        w0 = out[wkey]
        a, b = ab["A"].float(), ab["B"].float()  # A [r, in], B [out, r]
        if a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(w0.shape):
            raise SageGRPOError(
                f"LoRA shapes of {mod} (A {tuple(a.shape)}, B {tuple(b.shape)}) do not fit {tuple(w0.shape)}"
            )
        out[wkey] = (w0.float() + scale * (b @ a)).to(w0.dtype)  # [out, in]
    return out


def lora_scale(peft_cfg: Mapping[str, object]) -> float:
    """peft's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r = float(peft_cfg.get("lora_r", peft_cfg.get("r", 0)) or 0)
    alpha = float(peft_cfg.get("lora_alpha", 0) or 0)
    if r <= 0:
        raise SageGRPOError(f"LoRA rank missing or invalid in the checkpoint config: {dict(peft_cfg)}")
    return alpha / (r**0.5 if peft_cfg.get("use_rslora") else r)


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class VideoRewardFiles:
    """What was found on disk for one VideoReward checkpoint."""

    root: Path
    checkpoint_dir: Path
    step: int
    form: str  # "full" | "lora"
    config: dict = field(default_factory=dict)


def _read_json(path: Path, what: str) -> dict:
    """Read a JSON object; SageGRPOError naming the file and what to do when missing or corrupt."""
    if not path.is_file():
        raise SageGRPOError(f"{what}: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SageGRPOError(f"{what}: {path} is not valid JSON ({err}); re-download it") from None
    if not isinstance(data, dict):
        raise SageGRPOError(f"{what}: {path} must hold a JSON object")
    return data


def find_checkpoint(root: str | Path, step: int | None = None, form: str = "auto") -> VideoRewardFiles:
    """Locate ``model_config.json`` and ``checkpoint-<step>/`` (newest when ``step`` is None or -1)."""
    root = Path(root)
    hint = (
        "download the VideoReward checkpoint (hf download KlingTeam/VideoReward --local-dir <pretrained_model_root>/"
        "VideoReward) or point --reward_model_path at it"
    )
    if not root.is_dir():
        raise SageGRPOError(f"reward model directory {root} does not exist: {hint}")
    config = _read_json(root / "model_config.json", f"VideoReward config missing or broken ({hint})")
    ckpts = {}
    for p in root.glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and p.is_dir():
            ckpts[int(m[1])] = p
    if not ckpts:
        raise SageGRPOError(f"no checkpoint-<step>/ directory in {root}: {hint}")
    if step is None or step == -1:
        step = max(ckpts)
    elif step not in ckpts:
        raise SageGRPOError(f"checkpoint-{step} not in {root}; available steps: {sorted(ckpts)}")
    d = ckpts[step]
    has_full = (d / "model.pth").is_file()
    has_lora = (d / "adapter_model.safetensors").is_file() and (d / "non_lora_state_dict.pth").is_file()
    if form == "auto":
        form = "full" if has_full else "lora" if has_lora else ""
    if form == "full" and not has_full or form == "lora" and not has_lora or not form:
        raise SageGRPOError(
            f"{d} holds neither model.pth nor adapter_model.safetensors + non_lora_state_dict.pth"
            + (f" (asked for the {form} form)" if form else "")
            + f": {hint}"
        )
    if form not in ("full", "lora"):
        raise SageGRPOError(f"unknown weights form {form!r}; valid: auto, full, lora")
    return VideoRewardFiles(root=root, checkpoint_dir=d, step=step, form=form, config=config)


def load_pth(path: Path) -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True)`` of a tensor dict; corrupt or unsafe files become a SageGRPOError."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle/zip errors have many types
        raise SageGRPOError(
            f"cannot read {path} ({type(err).__name__}: {str(err)[:200]}); the file is corrupt, truncated or not a "
            "plain tensor state dict: re-download the checkpoint"
        ) from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SageGRPOError(f"{path} is not a state dict of tensors: re-download the checkpoint")
    return dict(state)


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file; a corrupt one becomes a SageGRPOError."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as err:  # noqa: BLE001
        raise SageGRPOError(f"cannot read {path} ({type(err).__name__}: {err}): re-download it") from None


def load_base_weights(base_dir: Path) -> dict[str, torch.Tensor]:
    """All ``*.safetensors`` of the base Qwen2-VL directory, keys prefixed as a PEFT-wrapped model's."""
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise SageGRPOError(
            f"the LoRA-only VideoReward checkpoint needs the base model weights, but {base_dir} has no *.safetensors:"
            " download Qwen/Qwen2-VL-2B-Instruct into --reward_base_model_path"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_safetensors(f))
    return {PEFT_PREFIX + k: v for k, v in state.items()}


def assemble_state_dict(files: VideoRewardFiles, base_dir: Path, mode: str) -> dict[str, torch.Tensor]:
    """The merged state dict in our model's key layout (``model.visual.*``, ``model.language_model.*``, ``rm_head``).

    Full form: model.pth alone. LoRA form: base weights, then non_lora_state_dict.pth over them, then the merged
    adapter (same order as the authors' loader). ``lm_head`` is dropped: the reward never uses it.
    """
    if files.form == "full":
        state = remap_keys(load_pth(files.checkpoint_dir / "model.pth"), mode)
    else:
        state = remap_keys(load_base_weights(base_dir), "v3")
        state.update(remap_keys(load_pth(files.checkpoint_dir / "non_lora_state_dict.pth"), mode))
        adapter = remap_keys(load_safetensors(files.checkpoint_dir / "adapter_model.safetensors"), mode)
        bad = [k for k in adapter if ".lora_" not in k]
        if bad:
            raise SageGRPOError(f"adapter_model.safetensors holds non-LoRA tensors such as {bad[0]!r}")
        state.update(adapter)
    has_lora = any(".lora_A" in k for k in state)
    if has_lora:
        peft_cfg = files.config.get("peft_lora_config") or {}
        if not peft_cfg:
            adapter_cfg = files.checkpoint_dir / "adapter_config.json"
            peft_cfg = _read_json(adapter_cfg, "LoRA config") if adapter_cfg.is_file() else {}
        state = merge_lora(state, lora_scale(peft_cfg))
    out = {}
    for k, v in state.items():
        if not k.startswith(PEFT_PREFIX):
            raise SageGRPOError(f"unexpected checkpoint key {k!r} (expected the PEFT prefix {PEFT_PREFIX!r})")
        k = k[len(PEFT_PREFIX) :]
        if k.startswith("lm_head."):
            continue
        out[k] = v
    return out


class VideoRewardNet(nn.Module):
    """Qwen2-VL (vision tower + language model, transformers 5) plus the bias-free ``rm_head`` (hidden -> out)."""

    def __init__(self, config, output_dim: int = 1, attn_implementation: str = "sdpa"):
        """Build with random weights from a ``Qwen2VLConfig`` whose vocab already includes the reward tokens."""
        super().__init__()
        from transformers import Qwen2VLModel

        self.model = Qwen2VLModel._from_config(config, attn_implementation=attn_implementation)
        self.rm_head = nn.Linear(config.text_config.hidden_size, output_dim, bias=False)


def load_state_strict(net: nn.Module, state: Mapping[str, torch.Tensor], mode: str) -> None:
    """Load with exact key and shape checks; mismatches become a SageGRPOError naming a few keys and a fix."""
    want = net.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise SageGRPOError(
            f"VideoReward checkpoint does not match the model (mode {mode}): {len(missing)} missing keys "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected keys (e.g. {unexpected[:3]}). Check that "
            "--reward_base_model_path is Qwen2-VL-2B-Instruct and try --reward_checkpoint_mode v3"
        )
    wrong = [
        (k, tuple(v.shape), tuple(want[k].shape)) for k, v in state.items() if tuple(v.shape) != tuple(want[k].shape)
    ]
    if wrong:
        raise SageGRPOError(
            f"VideoReward checkpoint shapes do not match the base config: {wrong[:3]} (checkpoint, model); "
            "--reward_base_model_path must be the Qwen2-VL-2B-Instruct the reward model was trained from"
        )
    net.load_state_dict(dict(state), strict=True)
