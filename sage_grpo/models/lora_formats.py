"""A LoRA of the HunyuanVideo-1.5 transformer in four key layouts, written by `scripts/export_checkpoint.py
--lora_format` and all read back by `sage_grpo.models.lora.read_adapter` (so `generate.py --lora_path` and
`--pretrained_lora_path` take any of them; the layout is detected from the keys):

    peft       adapter_model.safetensors (`base_model.model.<diffusers module>.lora_A.weight`) + adapter_config.json
               (a complete peft LoraConfig): `PeftModel.from_pretrained` / our own adapter.
    diffusers  pytorch_lora_weights.safetensors (`transformer.<diffusers module>.lora_A.weight`), the LoraConfig in
               the safetensors metadata `lora_adapter_metadata` with `transformer.`-prefixed keys, as diffusers'
               `write_lora_layers` stores it: `transformer.load_lora_adapter(dir, weight_name=...)` (0.42.1's
               HunyuanVideo15Pipeline has no `load_lora_weights`).
    original   lora_original.safetensors: the authors' module names (`double_blocks.0.img_attn_q`, ...), tensors
               `<module>.lora_A.weight` [r, in], `<module>.lora_B.weight` [out, r] and `<module>.alpha` (a scalar;
               scale = alpha / r per module, the kohya/ComfyUI convention, so the file needs no JSON beside it).
    comfy      lora_comfy.safetensors: ComfyUI's own names, `diffusion_model.<ComfyUI module>.lora_down.weight` (= A)
               / `.lora_up.weight` (= B) / `.alpha`, the layout ComfyUI's own LoRA extraction node writes. ComfyUI
               runs HunyuanVideo-1.5 as its HunyuanVideo model built from Flux's blocks, whose double blocks hold ONE
               fused `img_attn.qkv` / `txt_attn.qkv` linear (plus `img_mod.lin`, `img_mlp.0`/`.2`, `img_attn.proj`,
               MLPEmbedder `in_layer`/`out_layer`): the split img/txt q,k,v LoRAs are fused here like the refiner's
               (below) and every module is renamed by COMFY_RULES. Keys ComfyUI has no weight for would be skipped
               with "lora key not loaded"; tests/test_models_lora_formats.py rebuilds ComfyUI's key map and checks.

A LoRA is handled here as {module: (A, B, alpha)} with delta W = (alpha / rank) B A, rank = A.shape[0]. The module
mapping is `sage_grpo.models.convert.TRANSFORMER_RULES`, the one the weight loader uses:
  - a rename keeps A, B and alpha;
  - "swap" (final_layer.adaLN_modulation.1 stores (shift, scale), diffusers' norm_out.linear (scale, shift))
    permutes the output rows: B's two halves swap, A stays;
  - "qkv" (the token refiner's fused self_attn_qkv = rows [q; k; v] of diffusers' to_q/to_k/to_v): the three
    LoRAs become ONE exact LoRA of rank r_q + r_k + r_v: A = [A_q; A_k; A_v] stacked, B = blockdiag(B_q, B_k, B_v),
    so B A = [B_q A_q; B_k A_k; B_v A_v]; with equal scales s the fused alpha is s * (r_q + r_k + r_v). Back: a
    fused LoRA whose B is block diagonal in equal thirds splits into the three originals (so diffusers -> original
    -> diffusers is the identity); any other fused LoRA (e.g. one trained on the authors' model) splits exactly
    as A shared by the three and B cut into its q/k/v rows (what diffusers does for HunyuanVideo 1.0's
    img_attn_qkv in `_convert_hunyuan_video_lora_to_diffusers`).

Sources read (see docs/generation.md, "Using a trained LoRA"): ComfyUI (Comfy-Org/ComfyUI) comfy/lora.py ec93dcac
(`model_lora_keys_unet`: the generic `diffusion_model.<module>` rule and the HunyuanVideo branch; `load_lora`),
comfy/weight_adapter/lora.py 6f98b150 (`lora_up`/`lora_down`, scale alpha / rank), comfy/supported_models.py e3c35527
(`HunyuanVideo15(HunyuanVideo)` and its `process_unet_state_dict` renames), comfy/model_detection.py a9fc7512,
comfy/model_base.py 26adb81a (`class HunyuanVideo15(HunyuanVideo)`), comfy/lora_convert.py 2bffe2f4; the model's
modules from comfy/ldm/hunyuan_video/model.py and comfy/ldm/flux/layers.py (forks yzkee/ComfyUI 8d534945 and
hiddenswitch/pip-and-uv-installable-ComfyUI 5c6c95ea, the index holds no Comfy-Org copy of them). diffusers main
58eb52c0 (2026-08-23): loaders/lora_conversion_utils.py and lora_pipeline.py have no HunyuanVideo-1.5 LoRA
converter or loader mixin (HunyuanVideo 1.0's `_convert_hunyuan_video_lora_to_diffusers` shares A over the split
img_attn_qkv), scripts/convert_hunyuan_video1_5_to_diffusers.py (refiner self_attn_qkv split, final-layer
swap_scale_shift); the installed 0.42.1 `lora_base.write_lora_layers` / `peft.load_lora_adapter` (metadata layout).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.convert import TRANSFORMER_RULES, _pattern

__all__ = [
    "FORMATS",
    "FILE_NAMES",
    "Lora",
    "from_peft",
    "to_peft",
    "COMFY_RULES",
    "diffusers_to_authors_lora",
    "authors_to_diffusers_lora",
    "diffusers_to_comfy_lora",
    "comfy_to_diffusers_lora",
    "write_lora",
    "read_lora_file",
    "detect_format",
    "merge_into",
]

FORMATS = ("peft", "diffusers", "original", "comfy")
FILE_NAMES = {"peft": "adapter_model.safetensors", "diffusers": "pytorch_lora_weights.safetensors",
              "original": "lora_original.safetensors", "comfy": "lora_comfy.safetensors"}
PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
DIFFUSERS_PREFIX = "transformer."
COMFY_PREFIX = "diffusion_model."
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
FORMAT_METADATA_KEY = "sage_grpo_lora_format"

Lora = dict[str, tuple[Tensor, Tensor, float]]  # module -> (A [r, in...], B [out, r...], alpha)

# tensor-name suffixes of A / B per layout family
_AB_NAMES = {"peft": ("lora_A.weight", "lora_B.weight"), "comfy": ("lora_down.weight", "lora_up.weight")}


# ------------------------------------------------------------------------------------------------ peft <-> Lora


def _pattern_value(patterns: dict | None, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key: `(.*\\.)?(key)$`)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def from_peft(state: dict[str, Tensor], settings: dict) -> Lora:
    """peft-keyed adapter weights (`<module>.lora_A.weight`, no prefix) + their settings (r, lora_alpha,
    optional rank_pattern / alpha_pattern) -> Lora."""
    modules = _pair(state, *_AB_NAMES["peft"], what="peft adapter")
    out: Lora = {}
    for m, (a, b) in modules.items():
        rank = _pattern_value(settings.get("rank_pattern"), m, settings["r"])
        alpha = _pattern_value(settings.get("alpha_pattern"), m, settings["lora_alpha"])
        if rank != a.shape[0]:
            raise SageGRPOError(f"LoRA {m}: lora_A has rank {a.shape[0]} but the adapter settings say r={rank}")
        out[m] = (a, b, float(alpha))
    return out


def _number(x: float):
    return int(x) if float(x).is_integer() else float(x)


def to_peft(lora: Lora) -> tuple[dict[str, Tensor], dict]:
    """Lora -> (peft-keyed weights, settings {r, lora_alpha, target_modules, rank_pattern, alpha_pattern}): the most
    common rank and alpha are global, modules that differ get an exact-name pattern (escaped: peft reads regexes)."""
    if not lora:
        raise SageGRPOError("the LoRA has no modules")
    state = {}
    for m, (a, b, _alpha) in lora.items():
        state[f"{m}.lora_A.weight"], state[f"{m}.lora_B.weight"] = a, b
    r = Counter(a.shape[0] for a, _, _ in lora.values()).most_common(1)[0][0]
    alpha = Counter(al for _, _, al in lora.values()).most_common(1)[0][0]
    rank_pattern = {re.escape(m): a.shape[0] for m, (a, _, _) in lora.items() if a.shape[0] != r}
    alpha_pattern = {re.escape(m): _number(al) for m, (_, _, al) in lora.items() if al != alpha}
    settings = {"r": int(r), "lora_alpha": _number(alpha), "lora_dropout": 0.0, "target_modules": sorted(lora),
                "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}
    return state, settings


def _pair(state: dict[str, Tensor], a_name: str, b_name: str, what: str) -> dict[str, tuple[Tensor, Tensor]]:
    """{module: (A, B)} from `<module>.<a_name>` / `<module>.<b_name>`; anything else (or a half pair) is an error."""
    a_s, b_s, other = {}, {}, []
    for k, v in state.items():
        if k.endswith("." + a_name):
            a_s[k[: -len(a_name) - 1]] = v
        elif k.endswith("." + b_name):
            b_s[k[: -len(b_name) - 1]] = v
        else:
            other.append(k)
    half = sorted(set(a_s) ^ set(b_s))
    if other or half:
        bad = (other + half)[:3]
        raise SageGRPOError(f"{what}: keys that are not LoRA {a_name}/{b_name} pairs (LoRA biases, DoRA, LoKr... are "
                            f"not supported): {bad}")
    return {m: (a_s[m], b_s[m]) for m in sorted(a_s)}


# ---------------------------------------------------------------------------------------- diffusers <-> authors


def _swap_rows(b: Tensor) -> Tensor:
    """(shift, scale) <-> (scale, shift) along B's output rows; its own inverse (A is untouched)."""
    first, second = b.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _match(module: str, forward: bool):
    """The TRANSFORMER_RULES entry a module path matches -> (target module, op, q/k/v part or None), or None.
    forward: authors -> diffusers. The rules match full keys, so the module gets a stand-in `.weight`."""
    for src, dst, op in TRANSFORMER_RULES:
        m = _pattern(src if forward else dst).match(module + ".weight")
        if m is None:
            continue
        groups = {k: v for k, v in m.groupdict().items() if v is not None and k != "rest"}
        target = dst if forward else src
        for k, v in groups.items():
            target = target.replace("{" + k + "}", v)
        return target, op, groups.get("qkv")
    return None


def _unmapped(names: list[str], what: str) -> SageGRPOError:
    shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
    return SageGRPOError(f"{what}: {len(names)} LoRA modules are not HunyuanVideo-1.5 transformer modules: {shown}")


def diffusers_to_authors_lora(lora: Lora) -> Lora:
    """diffusers module names -> the authors' (fused q,k,v as one block-diagonal LoRA, final modulation rows
    swapped); the merged weight of every authors' module equals the converted merged diffusers weight."""
    out: Lora = {}
    fused: dict[str, dict[str, tuple[Tensor, Tensor, float]]] = {}
    unmapped = []
    for module, (a, b, alpha) in lora.items():
        hit = _match(module, forward=False)
        if hit is None:
            unmapped.append(module)
            continue
        target, op, part = hit
        if op == "qkv":
            fused.setdefault(target.replace("{qkv}", ""), {})[part] = (a, b, alpha)
        else:
            out[target] = (a, _swap_rows(b) if op == "swap" else b, alpha)
    if unmapped:
        raise _unmapped(unmapped, "diffusers-keyed LoRA")
    for target, parts in fused.items():
        out[target] = _fuse_qkv(parts, target)
    return dict(sorted(out.items()))


def _fuse_qkv(parts: dict[str, tuple[Tensor, Tensor, float]], target: str) -> tuple[Tensor, Tensor, float]:
    ref = next(iter(parts.values()))
    a0, b0 = ref[0], ref[1]
    out_dim = b0.shape[0]
    scales = {p: al / a.shape[0] for p, (a, _, al) in parts.items()}
    s = scales[next(iter(parts))]
    a_rows, b_blocks, rank = [], [], 0
    for p in "qkv":
        if p not in parts:  # no adapter on that projection: a rank-0 block (its rows of delta W stay 0)
            continue
        a, b, _ = parts[p]
        if b.shape[0] != out_dim or a.shape[1:] != a0.shape[1:]:
            raise SageGRPOError(f"LoRA for {target}: q/k/v parts have different shapes")
        a_rows.append(a)
        # one alpha for the fused module: equal scales (every adapter we train) keep B bit-exact
        b_blocks.append((p, b if scales[p] == s else b * (scales[p] / s)))
        rank += a.shape[0]
    a_fused = torch.cat(a_rows, dim=0)
    b_fused = torch.zeros((3 * out_dim, rank) + tuple(b0.shape[2:]), dtype=b0.dtype)
    col = 0
    for p, b in b_blocks:
        row = "qkv".index(p) * out_dim
        b_fused[row: row + out_dim, col: col + b.shape[1]] = b
        col += b.shape[1]
    return a_fused, b_fused, s * rank


def authors_to_diffusers_lora(lora: Lora) -> Lora:
    """The authors' module names -> diffusers' (inverse of `diffusers_to_authors_lora`; see the module doc for a
    fused q,k,v LoRA that is not block diagonal)."""
    out: Lora = {}
    unmapped = []
    for module, (a, b, alpha) in lora.items():
        hit = _match(module, forward=True)
        if hit is None:
            unmapped.append(module)
            continue
        target, op, _ = hit
        if op == "qkv":
            for p, part in zip("qkv", _split_qkv(a, b, alpha, module)):
                out[target.replace("{qkv}", p)] = part
        else:
            out[target] = (a, _swap_rows(b) if op == "swap" else b, alpha)
    if unmapped:
        raise _unmapped(unmapped, "original-keyed LoRA")
    return dict(sorted(out.items()))


def _split_qkv(a: Tensor, b: Tensor, alpha: float, module: str):
    rank = a.shape[0]
    if b.shape[0] % 3:
        raise SageGRPOError(f"LoRA for {module}: lora_B has {b.shape[0]} rows, not 3 equal q/k/v parts")
    rows = b.chunk(3, dim=0)
    if rank % 3 == 0:
        cols = rank // 3
        blocks = [r[:, i * cols: (i + 1) * cols] for i, r in enumerate(rows)]
        off_diagonal_zero = all(
            not torch.any(r[:, j * cols: (j + 1) * cols]) for i, r in enumerate(rows) for j in range(3) if j != i
        )
        if off_diagonal_zero:  # our own block-diagonal fusion: the three adapters back, bit for bit
            part_alpha = alpha * cols / rank
            return [(a[i * cols: (i + 1) * cols], blocks[i], part_alpha) for i in range(3)]
    # a general fused LoRA: delta W = s B A, rows [q; k; v] = s B_q A, s B_k A, s B_v A (A shared, rank unchanged)
    return [(a, r.contiguous(), alpha) for r in rows]


# ------------------------------------------------------------------------------------------- authors <-> ComfyUI

# (authors' module, ComfyUI's module) where they differ; {i} a block index, {s} img or txt. The inverse of the renames
# in ComfyUI's HunyuanVideo.process_unet_state_dict (comfy/supported_models.py), after the double blocks' q,k,v are
# fused into `{s}_attn_qkv`. Every other linear has the same name in both: txt_in.input_embedder, the refiner's
# adaLN_modulation.1, byt5_in.fc1/2/3, vision_in.proj.1/3, img_in.proj, final_layer.linear and
# final_layer.adaLN_modulation.1 (ComfyUI's LastLayer chunks it (shift, scale) like the authors').
_REFINER = "txt_in.individual_token_refiner.blocks.{i}."
COMFY_RULES: list[tuple[str, str]] = [
    ("time_in.mlp.0", "time_in.in_layer"),
    ("time_in.mlp.2", "time_in.out_layer"),
    ("txt_in.t_embedder.mlp.0", "txt_in.t_embedder.in_layer"),
    ("txt_in.t_embedder.mlp.2", "txt_in.t_embedder.out_layer"),
    ("txt_in.c_embedder.linear_1", "txt_in.c_embedder.in_layer"),
    ("txt_in.c_embedder.linear_2", "txt_in.c_embedder.out_layer"),
    (_REFINER + "self_attn_qkv", _REFINER + "self_attn.qkv"),
    (_REFINER + "self_attn_proj", _REFINER + "self_attn.proj"),
    (_REFINER + "mlp.fc1", _REFINER + "mlp.0"),
    (_REFINER + "mlp.fc2", _REFINER + "mlp.2"),
    ("double_blocks.{i}.{s}_mod.linear", "double_blocks.{i}.{s}_mod.lin"),
    ("double_blocks.{i}.{s}_attn_qkv", "double_blocks.{i}.{s}_attn.qkv"),
    ("double_blocks.{i}.{s}_attn_proj", "double_blocks.{i}.{s}_attn.proj"),
    ("double_blocks.{i}.{s}_mlp.fc1", "double_blocks.{i}.{s}_mlp.0"),
    ("double_blocks.{i}.{s}_mlp.fc2", "double_blocks.{i}.{s}_mlp.2"),
]
_DOUBLE_QKV = re.compile(r"^(double_blocks\.\d+\.(?:img|txt)_attn_)([qkv])$")


def _module_rx(path: str) -> re.Pattern:
    rx = re.escape(path).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{s\}", r"(?P<s>img|txt)")
    return re.compile(rf"^{rx}$")


_COMFY_RX = [(_module_rx(a), a, _module_rx(c), c) for a, c in COMFY_RULES]


def _rename(module: str, to_comfy: bool) -> str:
    for a_rx, a, c_rx, c in _COMFY_RX:
        m = (a_rx if to_comfy else c_rx).match(module)
        if m:
            out = c if to_comfy else a
            for k, v in m.groupdict().items():
                out = out.replace("{" + k + "}", v)
            return out
    return module


def diffusers_to_comfy_lora(lora: Lora) -> Lora:
    """diffusers module names -> ComfyUI's (the authors' layout, then each double block's img/txt q,k,v fused into
    one exact block-diagonal LoRA, then COMFY_RULES): ComfyUI's merged weight equals the converted diffusers merge."""
    authors = diffusers_to_authors_lora(lora)
    out: Lora = {}
    fused: dict[str, dict[str, tuple[Tensor, Tensor, float]]] = {}
    for m, v in authors.items():
        hit = _DOUBLE_QKV.match(m)
        if hit:
            fused.setdefault(hit.group(1) + "qkv", {})[hit.group(2)] = v
        else:
            out[m] = v
    for target, parts in fused.items():
        out[target] = _fuse_qkv(parts, target)
    return dict(sorted((_rename(m, to_comfy=True), v) for m, v in out.items()))


def comfy_to_diffusers_lora(lora: Lora) -> Lora:
    """ComfyUI module names (or the authors', which pass through) -> diffusers'; inverse of
    `diffusers_to_comfy_lora` (a fused double-block q,k,v splits like the refiner's, see the module doc)."""
    authors: Lora = {}
    for m, (a, b, alpha) in lora.items():
        m = _rename(m, to_comfy=False)
        if re.match(r"^double_blocks\.\d+\.(img|txt)_attn_qkv$", m):
            for p, part in zip("qkv", _split_qkv(a, b, alpha, m)):
                authors[m[: -len("qkv")] + p] = part
        else:
            authors[m] = (a, b, alpha)
    return authors_to_diffusers_lora(authors)


# ------------------------------------------------------------------------------------------------ files


def _settings_for_file(settings: dict, prefix: str = "") -> dict:
    keep = ("r", "lora_alpha", "lora_dropout", "target_modules", "rank_pattern", "alpha_pattern")
    return {prefix + k: settings[k] for k in keep}


def peft_config_dict(settings: dict, base_model: str = "") -> dict:
    """A complete adapter_config.json (what `LoraConfig(...).save_pretrained` writes) for `settings`."""
    from peft import LoraConfig

    cfg = LoraConfig(r=settings["r"], lora_alpha=settings["lora_alpha"], lora_dropout=settings["lora_dropout"],
                     target_modules=settings["target_modules"], rank_pattern=settings["rank_pattern"],
                     alpha_pattern=settings["alpha_pattern"], base_model_name_or_path=base_model or None)
    d = cfg.to_dict()
    return json.loads(json.dumps(d, default=lambda x: sorted(x) if isinstance(x, set) else str(x)))


def write_lora(lora: Lora, out_dir: Path, fmt: str, *, base_model: str = "") -> Path:
    """Write `lora` (diffusers module names) into `out_dir` in layout `fmt` -> the weights file."""
    if fmt not in FORMATS:
        raise SageGRPOError(f"--lora_format {fmt!r} is not one of {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILE_NAMES[fmt]
    meta = {"format": "pt", FORMAT_METADATA_KEY: fmt}
    if fmt in ("peft", "diffusers"):
        state, settings = to_peft(lora)
        if fmt == "peft":
            tensors = {PEFT_PREFIX + k: v for k, v in state.items()}
            (out_dir / PEFT_CONFIG).write_text(json.dumps(peft_config_dict(settings, base_model), indent=2) + "\n")
        else:
            tensors = {DIFFUSERS_PREFIX + k: v for k, v in state.items()}
            meta[DIFFUSERS_METADATA_KEY] = json.dumps(_settings_for_file(settings, DIFFUSERS_PREFIX), sort_keys=True)
    else:
        a_name, b_name = _AB_NAMES["comfy" if fmt == "comfy" else "peft"]
        prefix = COMFY_PREFIX if fmt == "comfy" else ""
        converted = diffusers_to_comfy_lora(lora) if fmt == "comfy" else diffusers_to_authors_lora(lora)
        tensors = {}
        for m, (a, b, alpha) in converted.items():
            tensors[f"{prefix}{m}.{a_name}"], tensors[f"{prefix}{m}.{b_name}"] = a, b
            tensors[f"{prefix}{m}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path, metadata=meta)
    return path


def detect_format(keys, metadata: dict | None = None) -> str:
    """The layout of a LoRA file from its keys (the metadata tag we write is only a tie-breaker: files from other
    tools carry none)."""
    keys = list(keys)
    tagged = (metadata or {}).get(FORMAT_METADATA_KEY)
    if any(k.startswith(COMFY_PREFIX) or k.endswith((".lora_up.weight", ".lora_down.weight")) for k in keys):
        return "comfy"
    if keys and all(k.startswith(DIFFUSERS_PREFIX) for k in keys):
        return "diffusers"
    modules = {k.rsplit(".lora_", 1)[0] for k in keys if ".lora_" in k}
    modules = {m[len(PEFT_PREFIX):] if m.startswith(PEFT_PREFIX) else m for m in modules}
    if modules and all(_match(m, forward=True) is not None for m in modules) and not all(
            _match(m, forward=False) is not None for m in modules):
        return "original"
    return tagged if tagged in ("peft", "original") else "peft"


def read_lora_file(path: Path) -> tuple[str, dict[str, Tensor], dict]:
    """-> (format, tensors, safetensors metadata) of one LoRA file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise SageGRPOError(f"LoRA {path} is not a readable safetensors file ({e})") from None
    return detect_format(tensors, metadata), tensors, metadata


def file_to_lora(fmt: str, tensors: dict[str, Tensor], metadata: dict, path: Path) -> Lora | None:
    """A diffusers / original / comfy file -> Lora with diffusers module names; None for peft (its settings live in
    adapter_config.json beside it, read by sage_grpo.models.lora)."""
    if fmt == "peft":
        return None
    if fmt == "diffusers":
        state = {k[len(DIFFUSERS_PREFIX):]: v for k, v in tensors.items()}
        raw = metadata.get(DIFFUSERS_METADATA_KEY)
        if raw:
            settings = {k[len(DIFFUSERS_PREFIX):] if k.startswith(DIFFUSERS_PREFIX) else k: v
                        for k, v in json.loads(raw).items()}
            return from_peft(state, settings)
        # no metadata: diffusers itself then takes alpha = r (scale 1); so do we
        return {m: (a, b, float(a.shape[0])) for m, (a, b) in _pair(state, *_AB_NAMES["peft"], str(path)).items()}
    prefix = COMFY_PREFIX if fmt == "comfy" else ""
    state = {k[len(prefix):] if prefix and k.startswith(prefix) else k: v for k, v in tensors.items()}
    alphas = {k[: -len(".alpha")]: float(v) for k, v in state.items() if k.endswith(".alpha")}
    state = {k: v for k, v in state.items() if not k.endswith(".alpha")}
    names = _AB_NAMES["comfy"] if any(k.endswith(".lora_up.weight") for k in state) else _AB_NAMES["peft"]
    pairs = _pair(state, *names, what=str(path))
    # no alpha key: scale 1 (ComfyUI's and kohya's rule)
    lora = {m: (a, b, alphas.get(m, float(a.shape[0]))) for m, (a, b) in pairs.items()}
    return comfy_to_diffusers_lora(lora) if fmt == "comfy" else authors_to_diffusers_lora(lora)


def merge_into(weights: dict[str, Tensor], lora: Lora) -> dict[str, Tensor]:
    """W + (alpha / r) B A for every LoRA module (fp32; conv kernels through their flattened matrix): the merged
    weights of either layout, for comparing layouts."""
    out = dict(weights)
    for m, (a, b, alpha) in lora.items():
        w = weights[f"{m}.weight"]
        delta = (b.float().flatten(1) @ a.float().flatten(1)).reshape(w.shape)
        out[f"{m}.weight"] = w.float() + (alpha / a.shape[0]) * delta
    return out
