"""Trainable parts of the policy: LoRA adapters (peft, through diffusers' PeftAdapterMixin) or full fine-tuning,
plus loading fine-tuned weights (LoRA safetensors, also into an FSDP2-sharded model; DCP `checkpoint-N/transformer`
directories and exported diffusers transformer folders)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sage_grpo.errors import SageGRPOError
from sage_grpo.files import usual_permissions

__all__ = [
    "ADAPTER_NAME",
    "default_lora_targets",
    "setup_trainable",
    "lora_state_dict",
    "save_lora",
    "load_lora",
    "sharded_lora_state",
    "load_lora_sharded",
    "saved_lora_settings",
    "load_dcp_transformer",
    "locate_trained_weights",
    "training_checkpoint",
    "load_trained_weights",
    "adapter_parameters",
    "merged_state_dict",
]

ADAPTER_NAME = "default"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"  # peft's name; holds r, lora_alpha, lora_dropout, target_modules


def default_lora_targets(transformer) -> list[str]:
    """Every nn.Linear inside the transformer blocks (full module names, so nothing outside them matches)."""
    return [n for n, m in transformer.named_modules()
            if n.startswith("transformer_blocks.") and isinstance(m, torch.nn.Linear)]


def setup_trainable(
    transformer, *, use_lora: bool, lora_r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0,
    lora_target_modules: list[str] | None = None, pretrained_lora_path: str = "",
    adapter_dtype: torch.dtype | None = None,
) -> list[torch.nn.Parameter]:
    """Make the policy trainable -> the parameters to optimise.

    LoRA: freeze the base weights and add peft adapters (r, alpha, dropout) on `lora_target_modules` (module
    names or suffixes as peft matches them; empty = every linear of the transformer blocks); optionally load
    `pretrained_lora_path`, whose saved adapter_config.json (when present) sets r, alpha and the targets.
    adapter_dtype: the adapters' dtype (the master weights' when the frozen base sits in the compute dtype); None
    keeps peft's choice. Full fine-tuning: every transformer parameter is trainable.
    """
    patterns: dict = {}  # per-module rank / alpha of an imported adapter (e.g. a fused q,k,v split back)
    if pretrained_lora_path and use_lora:
        saved = saved_lora_settings(pretrained_lora_path)
        if saved:  # the adapter's own shape and scale win: another alpha would load silently at the wrong strength
            lora_r, lora_alpha, lora_target_modules = saved["r"], saved["lora_alpha"], saved["target_modules"]
            patterns = {k: saved[k] for k in ("rank_pattern", "alpha_pattern") if saved.get(k)}
    if not use_lora:
        if pretrained_lora_path:
            raise SageGRPOError("--pretrained_lora_path needs --use_lora (or merge the adapter into the weights first)")
        transformer.requires_grad_(True)
        return [p for p in transformer.parameters()]
    from peft import LoraConfig

    transformer.requires_grad_(False)
    targets = list(lora_target_modules or []) or default_lora_targets(transformer)
    config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets,
                        init_lora_weights=True, **patterns)
    try:
        with warnings.catch_warnings():
            # an FP8 base (sage_grpo.models.fp8): peft warns for each quantized layer that merging needs torchao's
            # requantization config; the FP8 base is never merged (the adapter stays beside it)
            warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without")
            transformer.add_adapter(config, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # peft: "Target modules ... not found in the base model"
        raise SageGRPOError(f"--lora_target_modules {targets}: {e}") from e
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for p in params:
        if adapter_dtype is not None:
            p.data = p.data.to(adapter_dtype)
        p.requires_grad_(True)
    if pretrained_lora_path:
        load_lora(transformer, pretrained_lora_path)
    return params


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The adapter weights in peft's key layout (`transformer_blocks.0.attn.to_q.lora_A.weight`, ...)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)


def _config_file(weights: Path) -> Path:
    """adapter_config.json beside adapter_model.safetensors; <stem>_config.json beside any other file name."""
    return weights.with_name(ADAPTER_CONFIG if weights.name == ADAPTER_FILE else weights.stem + "_config.json")


def save_lora(transformer, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter as safetensors (a file path, or a directory that gets adapter_model.safetensors) and its
    settings (r, lora_alpha, lora_dropout, target_modules) as JSON beside it. `state`: the adapter already gathered
    (FSDP2: `sharded_lora_state`, a collective every rank ran), else read from the model."""
    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / ADAPTER_FILE
    state = lora_state_dict(transformer) if state is None else state
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, path)
    usual_permissions(path)  # safetensors writes 0600 (sage_grpo.files); an adapter is for others to load
    cfg = transformer.peft_config[ADAPTER_NAME]
    settings = {"r": cfg.r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                "target_modules": sorted(cfg.target_modules)}
    _config_file(path).write_text(json.dumps(settings, indent=1) + "\n")
    return path


def saved_lora_settings(path: str | Path) -> dict | None:
    """The settings of an adapter: the JSON `save_lora` (or peft) wrote beside it; for a diffusers / original /
    comfy file (sage_grpo.models.lora_formats) the ones its own tensors and metadata give; None when there are
    none (a bare peft file: the caller's flags apply)."""
    path = Path(path)
    cfg_path = path / ADAPTER_CONFIG if path.is_dir() else _config_file(path)
    if not cfg_path.is_file():
        from sage_grpo.models.lora_formats import file_to_lora, read_lora_file, to_peft

        weights = _adapter_file(path, required=False)
        if weights is None:
            return None
        fmt, tensors, metadata = read_lora_file(weights)
        lora = file_to_lora(fmt, tensors, metadata, weights)
        return None if lora is None else to_peft(lora)[1]
    try:
        data = json.loads(cfg_path.read_text())
        return {"r": int(data["r"]), "lora_alpha": data["lora_alpha"],
                "lora_dropout": float(data.get("lora_dropout", 0.0)),
                "target_modules": list(data["target_modules"]),
                "rank_pattern": dict(data.get("rank_pattern") or {}),
                "alpha_pattern": dict(data.get("alpha_pattern") or {})}
    except (ValueError, KeyError, TypeError) as e:
        raise SageGRPOError(f"LoRA settings {cfg_path} are unreadable ({e}); fix or delete the file") from None


def _adapter_file(path: Path, required: bool = True) -> Path | None:
    """A LoRA file, or the one in a directory: adapter_model.safetensors, else the file of an exported format,
    else the directory's only *.safetensors."""
    from sage_grpo.models.lora_formats import FILE_NAMES

    if path.is_dir():
        for name in (ADAPTER_FILE, *FILE_NAMES.values()):
            if (path / name).is_file():
                return path / name
        found = sorted(path.glob("*.safetensors"))
        if len(found) == 1:
            return found[0]
        if not required:
            return None
        raise SageGRPOError(f"LoRA adapter not found in {path}: no {ADAPTER_FILE} and "
                            f"{'several' if found else 'no'} *.safetensors files; pass the file itself")
    if not path.is_file():
        if not required:
            return None
        raise SageGRPOError(f"LoRA adapter not found: {path}")
    return path


def read_adapter(path: str | Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An adapter file (or a directory holding one) in any layout of sage_grpo.models.lora_formats (peft, diffusers,
    original, comfy: detected from the keys) -> (its path, the weights in peft's key layout on diffusers' module
    names, `transformer_blocks.0.attn.to_q.lora_A.weight`, ...)."""
    from sage_grpo.models.lora_formats import file_to_lora, read_lora_file, to_peft

    path = _adapter_file(Path(path))
    fmt, state, metadata = read_lora_file(path)
    lora = file_to_lora(fmt, state, metadata, path)
    if lora is not None:  # renamed / fused q,k,v split / modulation rows swapped back: exactly the diffusers LoRA
        return path, to_peft(lora)[0]
    for prefix in ("base_model.model.", "transformer."):
        state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    return path, state


def load_lora(transformer, path: str | Path) -> None:
    """Load adapter weights saved by `save_lora` (or a peft directory) into the transformer's adapter.
    Accepts keys with a `transformer.` / `base_model.model.` prefix. Unknown or missing LoRA keys are an error."""
    from peft import set_peft_model_state_dict

    path, state = read_adapter(path)
    _check_adapter_fits(path, state, {k: tuple(v.shape) for k, v in lora_state_dict(transformer).items()})
    set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER_NAME)


def _check_adapter_fits(path: Path, state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """The adapter's keys and shapes are the model's adapter's (`shapes`, peft names without the adapter name), else
    one error: keys name the targets and rank, shapes the base model (an adapter of another model's width would
    otherwise be torch's many-line size-mismatch report)."""
    missing, unexpected = set(shapes) - set(state), set(state) - set(shapes)
    if missing or unexpected:
        raise SageGRPOError(
            f"LoRA adapter {path} does not fit the model (check --lora_r / --lora_target_modules): "
            f"{len(missing)} missing (e.g. {sorted(missing)[:3]}), {len(unexpected)} unexpected (e.g. "
            f"{sorted(unexpected)[:3]})"
        )
    wrong = sorted(k for k in shapes if tuple(state[k].shape) != shapes[k])
    if wrong:
        k = wrong[0]
        raise SageGRPOError(
            f"LoRA adapter {path} does not fit the model: {len(wrong)} weights of another shape, e.g. {k} is "
            f"{list(state[k].shape)} in the adapter but {list(shapes[k])} in the model; it was trained on another "
            "base model (pass that one with --model_path) or with another rank"
        )


def sharded_lora_state(transformer) -> dict[str, torch.Tensor]:
    """`lora_state_dict` of an FSDP2 model (what `save_lora` writes), gathered whole on every rank (collective; the
    adapter is small)."""
    from sage_grpo.parallel.fsdp import gather_full

    return gather_full(lora_state_dict(transformer))


def load_lora_sharded(transformer, path: str | Path) -> None:
    """`load_lora` for an FSDP2 model: every rank reads the adapter file and copies its own rows (no collective)."""
    from sage_grpo.parallel.fsdp import copy_full_into_shards_

    path, state = read_adapter(path)
    params = {n.replace(f".{ADAPTER_NAME}.", "."): p for n, p in adapter_parameters(transformer).items()}
    _check_adapter_fits(path, state, {k: tuple(p.shape) for k, p in params.items()})  # a DTensor's: the whole
    copy_full_into_shards_(params, state)


def load_dcp_transformer(transformer, path: str | Path) -> None:
    """Load `checkpoint-N/transformer` (a torch.distributed.checkpoint directory holding {"model": state_dict}, the
    authors' layout) into `transformer`; works in a single process without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise SageGRPOError(f"--checkpoint_path {str(path)!r} is not a DCP directory (no .metadata); pass "
                            "checkpoint-N/transformer")
    state = {"model": get_model_state_dict(transformer)}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException: missing/mismatched keys
        raise SageGRPOError(
            f"--checkpoint_path {str(path)!r} does not fit this transformer ({str(e).strip().splitlines()[-1][:300]}); "
            "pass a full fine-tuning checkpoint of the same model (a LoRA run's adapter goes to --lora_path)"
        ) from None
    set_model_state_dict(transformer, state["model"])


EXPORT_WEIGHTS = "diffusion_pytorch_model.safetensors"  # diffusers' name; sharded: + ".index.json" and shards


def locate_trained_weights(path: str | Path) -> tuple[str, Path]:
    """What `generate.py --checkpoint_path` names -> ("dcp", the DCP directory) for a full fine-tuning checkpoint
    (checkpoint-N/transformer, or checkpoint-N itself), ("lora", checkpoint-N/lora) for a LoRA run's checkpoint
    (the adapter alone: merged into the base when loaded), or ("diffusers", the folder) for an exported transformer
    (config.json + diffusion_pytorch_model*.safetensors, what scripts/export_checkpoint.py writes). Anything else
    is one error, raised before any model loads."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return "dcp", p
    if (p / "transformer" / ".metadata").is_file():
        return "dcp", p / "transformer"
    if (p / "train_state.json").is_file() and (p / "lora" / ADAPTER_FILE).is_file():
        return "lora", p / "lora"
    weights = (p / EXPORT_WEIGHTS).is_file() or (p / f"{EXPORT_WEIGHTS}.index.json").is_file()
    if (p / "config.json").is_file() and weights:
        return "diffusers", p
    raise SageGRPOError(f"--checkpoint_path {str(path)!r} is neither a training checkpoint (output_dir/checkpoint-N or "
                        "its transformer/, written by post_train.py) nor an exported transformer (config.json + "
                        f"{EXPORT_WEIGHTS}, written by scripts/export_checkpoint.py)")


def training_checkpoint(path: str | Path) -> Path | None:
    """The training checkpoint (output_dir/checkpoint-N, whose train_state.json holds the run's config: its base
    model, task and settings) that `--checkpoint_path` names the weights of; None for an exported transformer, a
    DCP folder outside a checkpoint, or a path that is no trained weights at all (locate_trained_weights says why)."""
    try:
        kind, where = locate_trained_weights(path)
    except SageGRPOError:
        return None
    run = where.parent  # checkpoint-N/transformer or checkpoint-N/lora
    return run if kind != "diffusers" and (run / "train_state.json").is_file() else None


def load_trained_weights(transformer, path: str | Path) -> None:
    """Load `locate_trained_weights(path)` into `transformer` (every weight; a file of another model is one error)."""
    kind, path = locate_trained_weights(path)
    if kind == "dcp":
        load_dcp_transformer(transformer, path)
        return
    if kind == "lora":
        merge_adapter(transformer, path)
        return
    index = path / f"{EXPORT_WEIGHTS}.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [EXPORT_WEIGHTS]
    state = {}
    for name in files:
        state.update(load_file(path / name))
    expected = transformer.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise SageGRPOError(
            f"--checkpoint_path {str(path)!r} does not fit this transformer ({len(missing)} missing, e.g. "
            f"{missing[:2]}; "
            f"{len(unexpected)} unexpected, e.g. {unexpected[:2]}; {len(wrong)} of another shape, e.g. {wrong[:2]}); "
            "pass a transformer exported from a run of the same model")
    transformer.load_state_dict(state)


def merge_adapter(transformer, lora_dir: str | Path) -> None:
    """Merge the adapter saved in `lora_dir` into the plain `transformer`'s weights in place (W += alpha / r B A, as
    merged_state_dict computes it); the model stays a plain, frozen HunyuanVideo15Transformer3DModel."""
    setup_trainable(transformer, use_lora=True, pretrained_lora_path=str(lora_dir))
    merged = merged_state_dict(transformer)
    transformer.unload_lora()  # peft's wrappers out: the plain modules (and names) back
    transformer.load_state_dict(merged)
    transformer.requires_grad_(False)


def adapter_parameters(transformer) -> dict[str, torch.nn.Parameter]:
    """The trained adapter's parameters by peft name (the live tensors, for copying anchor adapter sets)."""
    tag = f".{ADAPTER_NAME}."
    return {n: p for n, p in transformer.named_parameters() if "lora_" in n and tag in n}


def merged_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The transformer's weights with the LoRA update merged in, under the plain model's key names (no peft
    `base_layer` / `lora_*` keys): W' = W + (alpha / r) B A, what peft's merge_and_unload computes, so the state
    dict loads into an unwrapped HunyuanVideo15Transformer3DModel. Without adapters: the plain state dict."""
    from sage_grpo.models.fp8 import is_quantized

    if is_quantized(transformer):  # an adapter merged into FP8 weights would be rounded away; merge into bf16 weights
        raise ValueError("merged_state_dict needs the unquantized base (load it without --fp8_base)")
    sd = transformer.state_dict()
    if not any("lora_" in k for k in sd):
        return dict(sd)
    from sage_grpo.models.lora_formats import _pattern_value

    cfg = transformer.peft_config[ADAPTER_NAME]

    def scale(module: str) -> float:  # per module: an imported adapter may carry rank / alpha patterns
        r = _pattern_value(cfg.rank_pattern, module, cfg.r)
        alpha = _pattern_value(cfg.alpha_pattern, module, cfg.lora_alpha)
        return alpha / (r ** 0.5 if getattr(cfg, "use_rslora", False) else r)

    out = {}
    for k, v in sd.items():
        if "lora_" in k:
            continue
        if ".base_layer." in k:
            module = k.rsplit(".base_layer.", 1)[0]
            if k.endswith(".base_layer.weight"):
                a = sd[f"{module}.lora_A.{ADAPTER_NAME}.weight"].float()  # [r, in]
                b = sd[f"{module}.lora_B.{ADAPTER_NAME}.weight"].float()  # [out, r]
                v = (v.float() + scale(module) * (b @ a)).to(v.dtype)
            k = k.replace(".base_layer.", ".")
        out[k] = v
    return out
