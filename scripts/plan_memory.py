"""Per-GPU memory plan of a post_train.py run with the real HunyuanVideo-1.5, computed without weights or a GPU.

    python scripts/plan_memory.py --config configs/single_node_8gpu.yaml --world_size 8
    python scripts/plan_memory.py --config configs/multinode_64gpu.yaml --world_size 64 --json
    python scripts/plan_memory.py --config configs/single_node_8gpu.yaml --world_size 8 \\
        --gradient_accumulation_steps 8 --save_interval 200   # the paper's 64-video update on one 8-GPU node

It takes the same `--config` and flags as post_train.py (sage_grpo.config.load_config / validate: an impossible
geometry ends with one message), plus `--world_size`, `--gpu_memory_gib` (80), `--text_tokens`, `--attention`,
`--fsdp_param_dtype`, `--overhead_gib`, `--num_prompts` / `--prompt_tokens` / `--glyph_tokens` (the text cache's
host memory), `--gpus_per_node` (8) and `--json`. A --batch_size whose videos per step do not make whole groups of
--num_generations (which post_train.py refuses) is planned at the next one that does, with a note.

When the peak does not fit `--gpu_memory_gib`, the plan lists the changes that lower it (the FP8 base for a LoRA
run, LoRA, bf16 master weights, the reward on its own GPUs, CFG off, fewer videos per rank, shorter videos, the
memory switches), each re-planned alone, largest saving first, then the same changes applied one after another
until the plan fits (a change that fits alone first), and exits 1 (0 when it fits, 2 for a user error):

    python scripts/plan_memory.py --world_size 1 --gpu_memory_gib 24 --use_lora True --master_weight_type bf16 \
        --enable_fsdp False --batch_size 4 --num_generations 4

The memory model is sage_grpo.memory (post_train.py's preflight plans with it too, on a CUDA device); this script is
its command line. Where each number comes from is below (from sage_grpo.memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sage_grpo.memory as memory  # noqa: E402
from sage_grpo.config import build_parser, load_config, torch_dtype  # noqa: E402
from sage_grpo.errors import run_cli  # noqa: E402
from sage_grpo.memory import (  # noqa: E402
    TYPICAL_PROMPT_TOKENS,
    PlanOptions,
    plan_run,
    validate_against_gpu_facts,
)


def __getattr__(name: str):
    """The model's other names (plan, count_transformer, GIB, TRANSFORMER_CONFIGS, ...) read through this module as
    before they moved to sage_grpo.memory (what is patched must be patched there)."""
    return getattr(memory, name)


# --help: this docstring, then the model's account of its numbers
DESCRIPTION = __doc__ + "\n" + memory.__doc__[memory.__doc__.index("Where each number comes from"):]


# ------------------------------------------------------------------------------------------------- output


def render(pl: dict) -> str:
    s, pr, tg, ph = pl["setting"], pl["params"], pl["terms_gib"], pl["phases_gib"]
    lines = [
        f"HunyuanVideo-1.5 {s['version']}: {pr['transformer']:,} parameters ({pr['num_blocks']} blocks x "
        f"{pr['per_block']:,}); trainable {pr['trainable']:,} "
        f"({'LoRA r=' + str(s['lora_r']) if s['use_lora'] else 'full'})"
        f", Muon share {pr['muon']:,}",
        f"world {s['world_size']} = dp {s['dp_degree']} (replicate {s['dp_replicate']} x shard {s['dp_shard']}) x sp "
        f"{s['sp_size']}; FSDP {'on: sharded over ' + str(s['shard_ranks']) + ' ranks' if s['fsdp'] else 'off'}; "
        f"{s['videos_per_round']} videos per round x {s['gradient_accumulation_steps']} = {s['videos_per_update']} per "
        "update",
        f"video {s['video']} -> latent {s['latent']}, {s['video_tokens']:,} video tokens "
        f"({s['video_tokens_per_rank']:,} "
        f"per rank) + {s['text_tokens']} text tokens ({s['attention']} attention); forward batch {s['forward_batch']}"
        f" (micro-batch x CFG); {s['dtype']} compute, {s['master_weight_type']} master, {s['optimizer']}, "
        f"checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, anchor {s['anchor']}",
        "",
        f"{'term (GiB per GPU)':44s} {'GiB':>8s}",
    ]
    for k, v in tg.items():
        lines.append(f"{k:44s} {v:8.2f}")
    lines += ["", f"{'phase':44s} {'GiB':>8s}"]
    for k, v in ph.items():
        lines.append(f"{k:44s} {v:8.2f}{'  <- peak' if k == pl['peak_phase'] else ''}")
    tr, lp = pl["traffic"], pl["loop"]
    lines += ["", f"{'collectives per step, per rank (est)':44s} {'GiB':>8s}  link",
              f"  ({lp['rollout_forwards']} rollout forwards, {lp['update_steps']} update forward+backward, "
              f"{lp['anchor_forwards']} anchor forwards; one whole-model all-gather = "
              f"{tr['model_gather_gib']:.2f} GiB)"]
    for k, v in tr.items():
        if isinstance(v, dict):
            link = "-" if v["gib"] == 0 else "InfiniBand" if v["inter_node"] else "NVLink"
            lines.append(f"{k:44s} {v['gib']:8.2f}  {link}")
    lines.append(f"{'total inter-node / intra-node':44s} {tr['inter_node_gib']:8.1f} / {tr['intra_node_gib']:.1f}")
    if pl.get("choices"):
        lines += ["", f"{'layout (same run)':66s} {'peak GiB':>8s}  {'inter-node GiB/step':>19s}  {'intra-node':>10s}"]
        for row in pl["choices"]:
            name = (f"{'full shard over' if row['dp_replicate'] == 1 else 'HSDP: shard over'} {row['shard_ranks']}"
                    f"{'' if row['dp_replicate'] == 1 else ' x ' + str(row['dp_replicate']) + ' replicas'}, rollout "
                    f"{row['rollout']}")
            lines.append(f"{name:66s} {row['peak_gib']:8.1f}  {row['inter_node_gib']:19.1f}  "
                         f"{row['intra_node_gib']:10.1f}{'' if row['fits'] else '  does NOT fit'}")
    verdict = "fits" if pl["fits"] else "does NOT fit"
    lines += ["", f"peak {pl['peak_gib']:.1f} GiB ({pl['peak_phase']}) {verdict} in {pl['gpu_memory_gib']:g} GiB "
              f"(headroom {pl['headroom_gib']:.1f} GiB). (est) = estimate not measured on a GPU; --help says where "
              "each number comes from."]
    if pl.get("note"):
        lines.append(f"note: {pl['note']}")
    rw = pl["reward"]
    if rw["remote"]:
        lines.append(f"reward: remote (scripts/serve_reward.py), none on these GPUs; VideoAlign on every rank would "
                     f"add {rw['local_gib']:.1f} GiB (model + forward, est) and raise the peak by "
                     f"{rw['peak_saving_gib']:.1f} GiB per rank.")
    else:
        lines.append(f"reward: VideoAlign on every rank, {rw['local_gib']:.1f} GiB (model + forward, est); "
                     f"--reward_model remote (a reward server on other GPUs) lowers the peak by "
                     f"{rw['peak_saving_gib']:.1f} GiB per rank.")
    h = pl["host_text_cache"]
    lines += ["", f"host memory per rank, text-embedding cache: {h['num_prompts']:,} prompts x {h['prompt_tokens']} "
              f"MLLM + {h['glyph_tokens']} ByT5 valid tokens ({h['per_prompt_mb']:.2f} MB each, {s['dtype']}):",
              f"  in memory (one process, no cache dir)       {h['in_memory_gb']:8.2f} GB per rank",
              f"  with a cache dir (default under torchrun)    {h['with_cache_dir_gb']:8.2f} GB per rank "
              f"({h['files_gb']:.2f} GB of files, read per batch)",
              f"  padded to 1000 + 256 tokens (before)         {h['padded_before_gb']:8.2f} GB per rank",
              f"  this run: {h['per_rank_gb']:.2f} GB per rank; each rank encodes {h['encoded_per_rank']:,} prompts"]
    ch = pl.get("changes")
    if ch is not None:
        lines += render_changes(ch, pl["gpu_memory_gib"])
    return "\n".join(lines)


def render_changes(ch: dict, gib: float) -> list[str]:
    """The lines of `fitting_changes`: each change alone, then together until the plan fits."""
    def row(r: dict) -> str:
        fits = "  fits" if r["fits"] else ""
        return f"  {r['flags']:56s} peak {r['peak_gib']:5.1f} GiB  (-{r['saving_gib']:.1f}){fits}"

    lines = ["", "changes that lower the peak, each alone (re-planned; largest saving first):"]
    lines += [row(r) for r in ch["alone"]] or ["  none: every memory setting the planner knows is already on"]
    if ch["together"]:
        lines += ["together, in that order, until it fits:"] + [row(r) for r in ch["together"]]
    if ch["fits"]:
        lines.append(f"fits {gib:g} GiB with: {' '.join(r['flags'] for r in ch['together'])}")
    else:
        lines.append(f"nothing above fits {gib:g} GiB: plan more GPUs (--world_size, with --enable_fsdp True and "
                     "--sp_size) or a smaller video (--height, --width)")
    return lines


def parse_args(argv: list[str] | None):
    d = PlanOptions()
    own = argparse.ArgumentParser(prog="plan_memory.py", description=DESCRIPTION, add_help=False, allow_abbrev=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--world_size", type=int, default=int(os.environ.get("WORLD_SIZE", d.world_size)),
                     help=f"GPUs of the run (default {d.world_size}, or $WORLD_SIZE).")
    own.add_argument("--gpu_memory_gib", type=float, default=d.gpu_memory_gib,
                     help=f"Memory per GPU in GiB (default {d.gpu_memory_gib:g}).")
    own.add_argument("--text_tokens", type=int, default=d.text_tokens,
                     help="Valid text tokens (MLLM + ByT5) of the longest prompt in a forward (default "
                          f"{d.text_tokens}).")
    own.add_argument("--attention", default=d.attention, choices=("valid", "diffusers"),
                     help="valid: the project's valid-token processor; diffusers: the dense-mask processor "
                     f"(default {d.attention}).")
    own.add_argument("--fsdp_param_dtype", default=d.fsdp_param_dtype,
                     help="Dtype of FSDP2's unsharded parameters (default --dtype).")
    own.add_argument("--overhead_gib", type=float, default=d.overhead_gib,
                     help=f"CUDA context, NCCL buffers, allocator fragmentation (default {d.overhead_gib:g}, an "
                          "estimate).")
    own.add_argument("--num_prompts", type=int, default=10_000,
                     help="Distinct prompts of the run, for the text cache's host memory (default 10000).")
    own.add_argument("--prompt_tokens", type=int, default=TYPICAL_PROMPT_TOKENS,
                     help=f"Valid MLLM tokens of a typical prompt (default {TYPICAL_PROMPT_TOKENS}, ~90 words).")
    own.add_argument("--glyph_tokens", type=int, default=0,
                     help="ByT5 tokens (bytes of quoted text) of a typical prompt (default 0).")
    own.add_argument("--gpus_per_node", type=int, default=d.gpus_per_node,
                     help=f"GPUs per node: which collectives cross InfiniBand (default {d.gpus_per_node}).")
    own.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    own.add_argument("--validate", action="store_true", help="Also compare the activation model with gpu_facts.md.")
    own.add_argument("-h", "--help", action="store_true")
    args, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.help:
        own.print_help()
        print("\nplus every post_train.py flag:")
        build_parser(prog="plan_memory.py").print_help()
        sys.exit(0)

    opts = PlanOptions(world_size=args.world_size, gpu_memory_gib=args.gpu_memory_gib, text_tokens=args.text_tokens,
                       attention=args.attention,
                       fsdp_param_dtype=args.fsdp_param_dtype, overhead_gib=args.overhead_gib,
                       num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens, glyph_tokens=args.glyph_tokens,
                       gpus_per_node=args.gpus_per_node)
    if opts.fsdp_param_dtype:
        torch_dtype(opts.fsdp_param_dtype)
    cfg = load_config(rest, prog="plan_memory.py")
    return cfg, opts, args



def main(argv: list[str] | None = None) -> dict:
    """Plan, print -> the plan (with "changes" when it does not fit); the exit status is 1 then."""
    cfg, opts, args = parse_args(argv)
    pl = plan_run(cfg, opts)
    if args.validate:
        pl["validation"] = validate_against_gpu_facts()
    if args.json:
        print(json.dumps(pl, indent=1))
    else:
        print(render(pl))
        for row in pl.get("validation", []):
            print(f"{row['what']:50s} predicted {row['predicted_gib']:6.3f}  measured {row['measured_gib']:6.3f}  "
                  f"ratio {row['ratio']:.3f}  {row['note']}")
    return pl


def cli(argv: list[str] | None = None) -> int:
    """The exit status: 0 when the plan fits, 1 when it does not (a user error: 2, from run_cli)."""
    return 0 if run_cli(main, argv)["fits"] else 1


if __name__ == "__main__":
    sys.exit(cli())
