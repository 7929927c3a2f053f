"""Resumable checkpoints in the authors' layout, written atomically.

    output_dir/checkpoint-{step}/
        transformer/          DCP {"model": state dict}: plain HunyuanVideo15Transformer3DModel keys (LoRA merged in),
                              what `generate.py --checkpoint_path .../transformer` loads
        optimizer/            DCP {"optimizer": ...} (torch.distributed.checkpoint.state_dict of every optimizer)
        lora/                 adapter_model.safetensors + adapter_config.json (LoRA runs; the weights resume loads)
        anchor/               DCP {"model": ...} of a refreshed full-model anchor, or anchor_lora.safetensors
                              (LoRA moving anchor); absent when the anchor is the initial model (rebuilt exactly)
        gradients/            DCP {name: gradient} of a checkpoint written inside a gradient accumulation (a stop
                              signal, the failed-reward limit): the rounds so far, resumed exactly
        rng_rank{r}.safetensors  torch CPU/CUDA generator states (dropout); every other draw is hash-seeded. A rank
                              with no file (a resume on more ranks) seeds them from (seed, step, rank)
        train_state.json      post_train's TrainState (counters, pending accumulation, KL controller, prompt
                              sampler, anchor bookkeeping), the config and file_digests (the judge template)

Everything is written into `checkpoint-{step}.tmp/` and renamed when complete (rank 0, after a barrier), so a
directory named `checkpoint-N` is always whole and `--resume_from_checkpoint latest` takes the newest of them.
Saving is collective: every rank calls `save_checkpoint` (the authors' rank-0-only final save hangs).

A checkpoint resumes on any valid layout (world size, --sp_size, --dp_replicate): the DCP parts are resharded on load,
the train state is the same for every rank, and `layout_change` says what changed (docs/scaling.md, "Continuing on
another number of GPUs").
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sage_grpo.config import Config, config_to_dict
from sage_grpo.errors import SageGRPOError
from sage_grpo.files import usual_permissions
from sage_grpo.parallel.dist import DistInfo, all_gather_cat, all_reduce_sum, barrier

__all__ = ["TRAIN_STATE", "CheckpointWriteError", "list_checkpoints", "resolve_resume", "save_checkpoint", "dcp_save",
           "dcp_load", "load_rng_state", "read_train_state", "exactness_diff", "file_digests", "resolved_settings",
           "EXACT_KEYS", "NEUTRAL_REWARD_KEYS", "CONTENT_KEYS", "RESOLVED_KEYS", "saved_layout", "layout_change",
           "pending_gradients", "load_pending_gradients", "pending_kl_by_dp_rank", "spread_pending_kl", "run_base",
           "record_resume", "RESUMES"]

TRAIN_STATE = "train_state.json"


class CheckpointWriteError(SageGRPOError):
    """A checkpoint could not be written (the message names the cause); older checkpoints are untouched."""

_NAME = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first -> [(step, path)]."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / TRAIN_STATE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def resolve_resume(spec: str, output_dir: str | Path) -> Path | None:
    """`--resume_from_checkpoint` -> a checkpoint directory, or None to start fresh ('' or 'latest' with none yet)."""
    if not spec:
        return None
    if spec == "latest":
        found = list_checkpoints(output_dir)
        if found:
            return found[-1][1]
        # none yet: a first run starts fresh, into a folder it creates with its parents (AUTO_RESUME=1 or a restart
        # policy on a fresh clone: ./outputs/... does not exist yet). Refused: a path that can never be a folder
        d = Path(output_dir)
        blocker = next((p for p in (d, *d.parents) if p.exists()), None)  # the nearest existing ancestor
        if blocker is not None and not blocker.is_dir():
            raise SageGRPOError(f"--resume_from_checkpoint latest: --output_dir {output_dir} can never be a run "
                                f"folder: {blocker} is a file; check --output_dir")
        return None
    p = Path(spec)
    if not (p / TRAIN_STATE).is_file():
        raise SageGRPOError(f"--resume_from_checkpoint {spec!r} is not a complete checkpoint (no {TRAIN_STATE}); "
                            f"pass output_dir/checkpoint-N or 'latest'")
    return p


RESUMES = "resumes.jsonl"
RUN_OUTPUTS = ("metrics.jsonl", "curves.png", "samples", "tensorboard", "wandb", "config.yaml", RESUMES,
               "validation_reference")


def run_outputs(output_dir: str | Path) -> list[Path]:
    """What a previous run left in `output_dir` (checkpoints, complete or not, and logs), sorted; the text-embedding
    cache is not a run's output (it stays valid)."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.name in RUN_OUTPUTS or re.match(r"^checkpoint-\d+(\.tmp)?$", p.name))


def clear_run(output_dir: str | Path) -> None:
    """Delete `run_outputs(output_dir)` (--overwrite_output_dir)."""
    for p in run_outputs(output_dir):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def record_resume(output_dir: str | Path, checkpoint: Path, step: int, overridden: dict, config: dict,
                  world_size: int) -> None:
    """Append a resume to output_dir/resumes.jsonl: the step it continued from, the checkpoint, the settings its
    flags changed, {"group.key": [saved, new]}, and the layout, [the checkpoint's, this launch's] (saved_layout,
    layout_of of `config` on `world_size` processes; the first None for a checkpoint that predates it). config.yaml
    holds the settings of the latest launch; with these records (undone newest first) it gives every earlier
    launch's, and the layouts say on how many processes each ran and how many videos a step took: the world size is
    in no config, and a layout change alters the batch without a flag (2 GPUs x 4 videos resumed on 1 GPU trains 4
    videos a step)."""
    line = {"step": step, "checkpoint": Path(checkpoint).name,
            "overridden": {k: [old, new] for k, (old, new) in overridden.items()},
            "layout": [saved_layout(read_train_state(checkpoint)), layout_of(config, world_size)]}
    with open(Path(output_dir) / RESUMES, "a") as f:
        f.write(json.dumps(line) + "\n")


def read_train_state(path: str | Path) -> dict:
    return json.loads((Path(path) / TRAIN_STATE).read_text())


def run_base(state: dict) -> tuple[str, str, str]:
    """The base model a checkpoint's run trained, from its train state's saved config -> (pretrained_model_root,
    model_path, pretrained_transformer_version), the arguments of sage_grpo.models.loading.locate_model /
    load_pipeline (relative paths as the run was given them). The run's task is the train state's "task"."""
    m = state["config"]["model"]
    return m["pretrained_model_root"], m["model_path"], m["pretrained_transformer_version"]


def dcp_save(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path))


def dcp_load(state: dict, path: Path, what: str) -> None:
    """Load into `state` in place; a checkpoint that does not fit is one user error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not (path / ".metadata").is_file():
        raise SageGRPOError(f"checkpoint part {path} is missing ({what})")
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise SageGRPOError(f"{path} does not fit this run's {what} ({str(e).strip().splitlines()[-1][:300]}); "
                            "resume with the settings of the saved run (model, --use_lora, --lora_r, "
                            "--use_muon)") from None


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_rng_state(path: Path, rank: int, seed: int | None = None, step: int = 0) -> bool:
    """Restore this rank's generators from rng_rank{rank} -> whether the file was there. A rank the saving run did
    not have (a resume on more ranks) has none: with `seed` given its generators are seeded from (seed, step, rank),
    the same on every launch; without, they are left as they are. Nothing a run computes depends on these states
    (dropout is refused; every other draw is hash-seeded), so neither choice changes a result; files of ranks that
    no longer exist are not read."""
    f = path / f"rng_rank{rank}.safetensors"
    if not f.is_file():
        if seed is not None:
            from sage_grpo.seeding import derive_seed

            torch.manual_seed(derive_seed(seed, step, rank, 0x52A6))  # every device's generator
        return False
    state = load_file(f)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True


def saved_layout(state: dict) -> dict | None:
    """The layout a checkpoint's train state was written on -> {world_size, sp_size, dp_replicate, dp, batch_size,
    videos (per round, all ranks), prompts (per step)}; None for a train state that predates "world_size"."""
    if "world_size" not in state:
        return None
    return layout_of(state["config"], int(state["world_size"]))


def layout_of(config: dict, world_size: int) -> dict:
    """A resolved config (config_to_dict layout) run on `world_size` processes -> its layout (see saved_layout)."""
    par, data = config.get("parallel", {}), config.get("data", {})
    sp, b, g = int(par.get("sp_size", 1)), int(data.get("batch_size", 1)), int(data.get("num_generations", 1))
    dp = world_size // sp
    return {"world_size": world_size, "sp_size": sp, "dp_replicate": int(par.get("dp_replicate", 1)), "dp": dp,
            "batch_size": b, "videos": b * dp, "prompts": b * dp // g}


def layout_change(saved_state: dict, current: dict, world_size: int, name: str = "the checkpoint") -> str | None:
    """One line saying how this launch's layout differs from the one `saved_state` was written on, and what that
    changes; None when it is the same (or the checkpoint does not record it). The same videos per round continue the
    run exactly up to the reduction order of the new layout; other videos per round continue it with more or fewer
    prompts per step (reported, not exact, like any EXACT_KEYS change)."""
    old, new = saved_layout(saved_state), layout_of(current, world_size)
    if old is None:
        return None
    keys = ("world_size", "sp_size", "dp_replicate", "batch_size")
    if all(old[k] == new[k] for k in keys):
        return None
    labels = {"world_size": "world size", "sp_size": "sp_size", "dp_replicate": "dp_replicate",
              "batch_size": "batch_size per rank"}
    changed = ", ".join(f"{labels[k]} {old[k]} -> {new[k]}" for k in keys if old[k] != new[k])
    line = f"{name} was written on another layout: {changed} (data-parallel ranks {old['dp']} -> {new['dp']}); "
    if old["videos"] == new["videos"]:
        return line + (f"the same {new['videos']} videos ({new['prompts']} prompts) per step: weights, optimizer "
                       "state, anchor and pending gradients are resharded, counters, KL controller and prompt sampler "
                       "continue; exact up to the new layout's reduction order")
    g = new["videos"] // max(new["prompts"], 1)
    hint = (f"; pass --batch_size {old['videos'] // new['dp']} to keep them" if old["videos"] % new["dp"] == 0
            and (old["videos"] // new["dp"]) * new["dp"] % g == 0 else "")
    return line + (f"NOT the same batch: {old['videos']} -> {new['videos']} videos ({old['prompts']} -> "
                   f"{new['prompts']} prompts) per step, so the prompt sampler takes {new['prompts']} prompts per "
                   f"step from where it stopped and the run continues, not exactly{hint}")


# --------------------------------------------------------------- a pending accumulation, on another layout too


def pending_gradients(model: torch.nn.Module, info: DistInfo, fsdp: bool) -> dict[str, torch.Tensor]:
    """The gradients accumulated into the pending update, by parameter name, as the layout-free mean gradient so far
    (what the optimizer would see after `sync_gradients`): under FSDP2 (`fsdp`) this rank's shards of it
    (reduce-scattered in backward), in one process the gradients themselves, on several ranks without FSDP2 the sum
    over every rank divided by dp (collective). Parameters without a gradient are left out: the optimizer skips them,
    and a zero would not be skipped (without FSDP2 the sync gives every parameter one, so all are kept there)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not info.distributed or fsdp:
        return {n: p.grad for n, p in named if p.grad is not None}
    return {n: all_reduce_sum(p.grad.clone() if p.grad is not None else torch.zeros_like(p)).div_(info.dp_size)
            for n, p in named}


def load_pending_gradients(model: torch.nn.Module, info: DistInfo, fsdp: bool, path: Path) -> None:
    """Restore `pending_gradients` from a checkpoint's gradients/ (DCP, resharded to this run's layout). On several
    ranks without FSDP2 rank 0 takes dp x the mean and the others zeros, so that the sync's sum / dp gives it back."""
    import torch.distributed.checkpoint as dcp

    params = dict(model.named_parameters())
    names = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    grads = {n: torch.zeros_like(params[n]) for n in names}
    dcp_load(grads, path, "pending gradients")
    replicated = info.distributed and not fsdp
    for n, g in grads.items():
        params[n].grad = (g.mul_(info.dp_size) if info.is_main else g.zero_()) if replicated else g


def pending_kl_by_dp_rank(kl_sum: float, pairs: int, info: DistInfo) -> list[list[float]]:
    """[[L_KL sum, valid pairs] of the pending update] per data-parallel rank (collective; `kl_sum`, `pairs`: this
    rank's): the train state is written by rank 0, so each rank's own share is saved here (`spread_pending_kl` gives
    it back)."""
    mine = torch.tensor([[kl_sum, float(pairs)]], dtype=torch.float64, device=info.device)
    return all_gather_cat(mine, group=info.dp_group).cpu().tolist()


def spread_pending_kl(rows: list | None, info: DistInfo) -> tuple[float, int] | None:
    """This rank's pending L_KL sum and pair count from `pending_kl_by_dp_rank`'s rows: its own on the same number of
    data-parallel ranks; on another, data-parallel rank 0 takes the totals and the others zero (the update uses their
    sum over the ranks only). None (a checkpoint before this): rank 0's values as saved stay, on every rank."""
    if rows is None:
        return None
    if len(rows) == info.dp_size:
        total_sum, total_pairs = rows[info.dp_rank]
    elif info.dp_rank == 0:
        total_sum, total_pairs = sum(r[0] for r in rows), sum(r[1] for r in rows)
    else:
        total_sum, total_pairs = 0.0, 0
    return float(total_sum), int(total_pairs)


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    rank: int,
    model_state: dict | None,
    optimizer_state: dict,
    train_state: dict,
    lora_writer=None,
    anchor_state: dict | None = None,
    anchor_lora: dict[str, torch.Tensor] | None = None,
    gradient_state: dict | None = None,
    total_limit: int = 0,
) -> Path:
    """Write checkpoint-{step} atomically (collective) -> its path. lora_writer(dir) writes the adapter (rank 0).

    Everything goes to checkpoint-{step}.tmp, renamed when complete. A write that fails on any rank (disk full,
    read-only output dir) is agreed by all ranks: the partial folder is removed, the older checkpoints stay as they
    were, and every rank raises CheckpointWriteError (no rank is left waiting in a collective)."""
    out = Path(output_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f"checkpoint-{step}.tmp"

    def agreed(stage) -> None:
        err = None
        try:
            stage()
        except Exception as e:  # noqa: BLE001 - OSError (disk full, permissions), or DCP's CheckpointException
            err = e  # wrapping it (DCP raises on every rank when one rank's write failed)
        failed = all_reduce_sum(torch.tensor([float(err is not None)]))
        if float(failed[0]) > 0:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier()
            reason = (getattr(err, "strerror", None) or str(err)) if err is not None else "failed on another rank"
            raise CheckpointWriteError(f"checkpoint-{step} could not be written to {out} ({reason}); the previous "
                                       "checkpoints are intact") from None

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt that died half-way
            tmp.mkdir(parents=True)

    def write() -> None:
        if model_state is not None:  # None: a LoRA run (its adapter is written by lora_writer)
            dcp_save({"model": model_state}, tmp / "transformer")
        dcp_save({"optimizer": optimizer_state}, tmp / "optimizer")
        if anchor_state is not None:
            dcp_save({"model": anchor_state}, tmp / "anchor")
        if gradient_state is not None:
            dcp_save(gradient_state, tmp / "gradients")
        rng = tmp / f"rng_rank{rank}.safetensors"
        save_file({k: v.contiguous() for k, v in _rng_state().items()}, rng)
        usual_permissions(rng)  # safetensors writes 0600 (sage_grpo.files)
        if rank == 0:
            if lora_writer is not None:
                lora_writer(tmp / "lora")
            if anchor_lora is not None:
                save_file({k: v.detach().contiguous().cpu() for k, v in anchor_lora.items()},
                          tmp / "anchor_lora.safetensors")
                usual_permissions(tmp / "anchor_lora.safetensors")

    def commit() -> None:
        if rank == 0:
            (tmp / TRAIN_STATE).write_text(json.dumps(train_state, indent=1) + "\n")  # marks completeness
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)

    agreed(prepare)
    agreed(write)
    agreed(commit)
    if rank == 0 and total_limit > 0:  # only once the new checkpoint is complete
        for _, old in list_checkpoints(out)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


# ------------------------------------------------------------------------- what an exact continuation keeps
# THE list of the settings whose change makes a resumed run differ from an uninterrupted one (the run still resumes;
# the changed names are reported). group -> keys; None = every key of the group. Groups not named here (parallel,
# validation, checkpoint, logging) change nothing that is trained. A new flag of a listed group that changes the
# samples, a score, the loss or the update belongs here; one of the reward group that does not belongs in
# NEUTRAL_REWARD_KEYS: tests/test_checkpoint.py fails on a reward flag in neither, because a score-changing flag left
# out of this list makes a resume that changes the reward report itself exact.
EXACT_KEYS: dict[str, tuple[str, ...] | None] = {
    # vae_tiling: tiles change the decoded pixels; fp8_base, fp8_matmul: the quantized base (and its FP8 products)
    # is another function than the bf16 one, in every sample and gradient
    "model": ("pretrained_transformer_version", "dtype", "master_weight_type", "use_lora", "lora_r", "lora_alpha",
              "lora_dropout", "lora_target_modules", "vae_tiling", "fp8_base", "fp8_matmul"),
    "data": ("train_video_csv", "batch_size", "num_generations"),
    "rollout": None,
    "reward": ("reward_model", "reward_weights", "reward_combine", "reward_optional", "reward_checkpoint_mode",
               "reward_checkpoint_step", "reward_max_pixels", "reward_min_pixels", "reward_sample_fps", "reward_dtype",
               "judge_model", "judge_template", "judge_scale", "judge_frames", "judge_video", "judge_max_tokens"),
    "kl": None,
    "optim": ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "warmup_steps",
              "gradient_accumulation_steps", "max_grad_norm", "use_muon", "seed", "clip_range", "adv_clip_max",
              "timestep_fraction", "enable_timestep_permutation", "group_timesteps",
              "use_grad_balancing", "mini_batch_size_per_update",
              "updates_per_rollout"),
}
# Reward settings that change no score: where the weights or the servers are (a moved folder or another replica of
# the same server), how the videos are batched, sent, retried or overlapped, and when a run gives up.
NEUTRAL_REWARD_KEYS = ("reward_model_path", "reward_base_model_path", "clip_model_path", "pickscore_model_path",
                       "pickscore_processor_path", "reward_url", "judge_url", "reward_batch_size", "reward_timeout",
                       "reward_retries", "reward_overlap", "max_failed_reward_steps", "judge_concurrency",
                       "judge_allow_http_key")
# Exactness keys that name a file whose text is the setting: compared by the SHA-256 of the file (saved in the
# checkpoint's train state as "digests"), so that an edited template is reported and the same file moved or reached
# by another relative path is not. Only small files are listed (a judge template: hashing it is free).
CONTENT_KEYS = (("reward", "judge_template"),)
# Exactness keys whose value the run resolves when it starts: --judge_model "" asks for the one model the judge
# server lists. The value used (saved in the checkpoint's train state as "resolved") is compared, so that another
# model served under the same flags is reported, and naming the model the server listed is exact.
RESOLVED_KEYS = (("reward", "judge_model"),)


def file_digests(config: dict) -> dict[str, str]:
    """The SHA-256 of the file each CONTENT_KEYS setting of the config dict names, by "group.key" ("" = no file set,
    "unreadable" = set but not a readable file)."""
    import hashlib

    out = {}
    for group, key in CONTENT_KEYS:
        path = str(config.get(group, {}).get(key) or "")
        digest = ""
        if path.strip():
            try:
                digest = hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
            except OSError:
                digest = "unreadable"
        out[f"{group}.{key}"] = digest
    return out


def resolved_settings(reward) -> dict[str, str]:
    """The value each RESOLVED_KEYS setting took in a run whose reward (a CompositeReward) is ``reward``, by
    "group.key": the model its judge asks for (--judge_model, or the one its server lists); {} without a judge."""
    judge = getattr(reward, "rewards", {}).get("vlm_judge")
    return {} if judge is None else {"reward.judge_model": judge.model}


def exactness_diff(saved: dict, current: dict, saved_digests: dict | None = None,
                   current_digests: dict | None = None, *, saved_dp: int = 1, current_dp: int = 1,
                   saved_resolved: dict | None = None, current_resolved: dict | None = None) -> list[str]:
    """Names of the settings (group.key: old -> new) that differ between the saved and the current resolved config
    (config_to_dict layout) and make the resumed run differ from an uninterrupted one. A key missing from either
    (a checkpoint written before the flag existed) counts as its default: the run it wrote behaved as the default
    does. The digests (file_digests) compare CONTENT_KEYS by content when both are given; a checkpoint written
    without them is compared by path. `data.batch_size` is per data-parallel rank: what must stay is the videos per
    step, batch_size x dp (saved_dp, current_dp: the data-parallel ranks of each run), so a resume on another
    number of ranks with the same videos per step is exact. The resolved values (resolved_settings) compare
    RESOLVED_KEYS by the value used when both runs recorded one; a checkpoint written without them compares the
    flag."""
    defaults = config_to_dict(Config())
    diffs = []
    for group, keys in EXACT_KEYS.items():
        a, b, d = saved.get(group, {}), current.get(group, {}), defaults.get(group, {})
        for k in keys if keys is not None else sorted(set(a) | set(b) | set(d)):
            old, new = a.get(k, d.get(k)), b.get(k, d.get(k))
            name = f"{group}.{k}"
            if (group, k) == ("data", "batch_size") and saved_dp != current_dp:
                if old * saved_dp != new * current_dp:
                    diffs.append(f"{name}: {old!r} -> {new!r} (videos per step {old * saved_dp} -> "
                                 f"{new * current_dp} on {saved_dp} -> {current_dp} data-parallel ranks)")
            elif (group, k) in CONTENT_KEYS and saved_digests and name in saved_digests and current_digests:
                if saved_digests[name] != current_digests.get(name):
                    diffs.append(f"{name}: {old!r} -> {new!r} (its content differs)")
            elif (group, k) in RESOLVED_KEYS and name in (saved_resolved or {}) and name in (current_resolved or {}):
                if saved_resolved[name] != current_resolved[name]:
                    diffs.append(f"{name}: {old!r} -> {new!r} (used: {saved_resolved[name]!r} -> "
                                 f"{current_resolved[name]!r})")
            elif old != new:
                diffs.append(f"{name}: {old!r} -> {new!r}")
    return diffs
