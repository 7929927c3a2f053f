#!/usr/bin/env python
"""The real HunyuanVideo-1.5 (8.3B) built, loaded, LoRA-trained, resumed, exported, sharded and generated on a CPU.

    python scripts/real_size_cpu.py                      # every stage at the real size (about an hour on 2 cores)
    python scripts/real_size_cpu.py --miniature          # the same stages on miniature configs (a minute; the test)
    python scripts/real_size_cpu.py --stages train,resume --keep

Stages (each a process of the project's own entry points; per-phase peak RSS from a sampler inside that process):
  checkpoint  a random-weight checkpoint of the real shapes (sage_grpo.models.full_size: transformer 8.3B, VAE,
              Qwen2.5-VL-7B text tower, ByT5, in the diffusers layout, bf16 shards), written shard by shard
  train       post_train.py, one process: bf16 compute, LoRA (fp32 adapters over the bf16 base), gradient
              checkpointing, G 2, T 4, 5 frames at 64x64, CFG off (--cfg_scale), the weight-free brightness
              reward, 2 steps, a checkpoint
              after each; peak RSS per phase (conditioning load, text encoding, policy load, rollout, reward, update,
              optimizer, save), load and step times
  resume      a second run resumed from the first run's checkpoint-1 for its step 2: its adapter must equal the first
              run's step-2 adapter bitwise
  export      scripts/export_checkpoint.py to the peft and ComfyUI LoRA formats, then generate.py with the peft export
  fsdp        post_train.py under torchrun, 2 gloo ranks, FSDP2: the sharded meta-device load's per-rank peak RSS,
              what is alive on each rank at each phase's end (tensors by owner, memory by mapping, malloc's free
              bytes) and how far the ranks differ, and one LoRA step against the one-process step 1 (when the train
              stage ran in --work; alone, it measures the ranks only)
  planner     scripts/plan_memory.py for the same settings next to the measured peaks
  block       scripts/bench_attention.py: one real-width block, forward + backward at the rollout's token count, the
              valid-token processor against diffusers' stock processor
  authors     the authors' layout (tencent/HunyuanVideo-1.5) of --authors_version at the real size, written by
              sage_grpo.models.full_size (one transformer safetensors file in their key names, the whole Qwen2.5-VL
              with its vision tower and --authors_text_layers text layers, the glyph byt5_model.pt; I2V:
              vision_encoder/siglip; the bucket base target_size = --size): post_train.py one LoRA
              step straight from it (I2V: a reference image per prompt), then scripts/convert_authors_checkpoint.py,
              whose output is checked tensor by tensor against the values written; runs after the diffusers
              checkpoint is deleted (unless --keep) and deletes its own folders unless --keep

It first checks free disk and RAM and says in one line what it needs; it deletes its checkpoints at the end unless
--keep. Writes <work>/real_size_cpu.json and prints a table (docs/performance.md holds the measured one).
Inner mode (used by the stages): `real_size_cpu.py --meter REPORT.json -- <post_train.py, generate.py or
convert_authors_checkpoint.py args>`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ("checkpoint", "train", "resume", "export", "fsdp", "planner", "block", "authors")
# what the checkpoint and the runs in --work depend on: a later invocation reuses and compares with them
SETTINGS = ("miniature", "blocks", "real_vae", "text_layers", "frames", "size", "cfg_scale", "fp8_base")
PROMPTS = ("a red ball rolls across the grass", "a cat sleeps on a sunny windowsill")
# What the real-size stages need (measured: the checkpoint is 31.4 GiB; the one-process training peak ~18 GiB)
REAL_DISK_GIB, REAL_RAM_GIB = 36, 22


def authors_disk_gib(text_layers: int) -> int:
    """GiB of disk of the authors stage: its checkpoint and the converted copy side by side (bf16; from the parameter
    counts: transformer 15.5 twice, VAE 2.3 + 4.7 (fp32 once converted), the Qwen2.5-VL's embeddings, head and vision
    tower 3.3, the converted text tower's embeddings 1.0, ByT5 0.4 and SigLIP 0.8 twice, 0.43 per Qwen text layer
    twice)."""
    return int(45 + 2 * 0.434 * text_layers) + 1


# ------------------------------------------------------------------------------------------------------ the meter


def rss_bytes() -> tuple[int, int]:
    """(resident bytes, of which anonymous): safetensors weights loaded without a dtype change stay memory-mapped
    (file pages, paged in when first used), so RSS counts them as they are touched and RssAnon does not."""
    total = anon = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    return total, anon


def live_tensor_bytes() -> dict[str, int]:
    """Bytes of the distinct storages that live Python tensors hold, by owner: parameters (a DTensor's local shard
    counted), their gradients, any other tensor. Storages reachable only from C++ (autograd's saved tensors) are not
    seen; a storage counts once, under the first owner found in that order."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    seen: set[int] = set()
    out = {"parameters": 0, "gradients": 0, "other tensors": 0}

    def count(t, kind: str) -> None:
        t = local(t)
        if t.device.type == "meta":
            return
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            # a wrapper tensor subclass (torchao's Float8Tensor, which an FP8 layer builds as it runs) has no storage
            # of its own: its inner tensors hold the bytes
            for name in t.__tensor_flatten__()[0]:
                count(getattr(t, name), kind)
            return
        st = t.untyped_storage()
        if st.data_ptr() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out[kind] += st.nbytes()

    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    params = [t for t in tensors if isinstance(t, torch.nn.Parameter)]
    for t in params:
        count(t, "parameters")
    for t in params:
        if t.grad is not None:
            count(t.grad, "gradients")
    for t in tensors:
        count(t, "other tensors")
    return out


def mapped_bytes() -> dict[str, int]:
    """Resident bytes of this process by where they live (/proc/self/smaps): anonymous memory in the heap, in
    anonymous mappings (large allocations, thread arenas), in file mappings (private pages written: copy-on-write),
    file pages of safetensors files and of other files; and glibc's free bytes held in its arenas (mallinfo2)."""
    import ctypes

    out = {"heap": 0, "anonymous mappings": 0, "written file pages": 0, "safetensors file pages": 0,
           "other file pages": 0}
    path, rss = "", 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's header line
                path = head[5] if len(head) > 5 else ""
            elif head[0] == "Rss:":
                rss = int(head[1]) * 1024
            elif head[0] == "Anonymous:":
                anon = int(head[1]) * 1024
                if path == "[heap]":
                    out["heap"] += anon
                elif path.startswith("/"):
                    out["written file pages"] += anon
                    key = "safetensors file pages" if path.endswith(".safetensors") else "other file pages"
                    out[key] += rss - anon
                else:
                    out["anonymous mappings"] += anon

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Mallinfo2
        out["malloc free in arenas"] = int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):  # not glibc
        pass
    return out


class PhaseMeter:
    """Peak RSS and seconds per named phase of this process: a thread samples /proc/self/statm every `every` s and
    charges the sample to the innermost open phase (nested phases: the inner one)."""

    def __init__(self, every: float = 0.02, path: Path | None = None, probe: bool = False):
        self.every = every
        self.probe = probe  # also record what is alive at each phase's end (a scan of every live object)
        self.path = path  # the report, rewritten at the end of every phase: a run killed later still leaves it
        self.stack: list[str] = ["start"]
        self.peak: dict[str, int] = {}
        self.peak_anon: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.order: list[str] = []
        self.at_end: dict[str, dict] = {}  # phase -> what is alive when it ends (tensors by owner, mappings), GiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        (rss, anon), name = rss_bytes(), self.stack[-1]
        self.peak[name] = max(rss, self.peak.get(name, 0))
        self.peak_anon[name] = max(anon, self.peak_anon.get(name, 0))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def start(self) -> PhaseMeter:
        self._thread.start()
        return self

    @contextmanager
    def phase(self, name: str):
        self._sample()
        self.stack.append(name)
        if name not in self.order:
            self.order.append(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sample()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            if self.probe:
                self.at_end[name] = {k: v / 2**30 for k, v in {**live_tensor_bytes(), **mapped_bytes()}.items()}
            self.stack.pop()
            if self.path is not None:
                self.path.write_text(json.dumps(self.report(), indent=1) + "\n")

    def report(self) -> dict:
        self._sample()
        import resource

        return {"phases": [{"phase": n, "peak_rss_gib": self.peak.get(n, 0) / 2**30,
                            "peak_anon_gib": self.peak_anon.get(n, 0) / 2**30,
                            "seconds": self.seconds.get(n, 0.0), "at_end_gib": self.at_end.get(n, {})}
                           for n in self.order],
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def policy_bytes(transformer) -> int:
    """Bytes of the transformer's parameter storage on this rank (an FSDP2 rank's shards; an FP8 layer's data and
    scales are two plain parameters), each storage once."""
    seen, total = set(), 0
    for p in transformer.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p  # DTensor: this rank's shard
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _wrap(owner, name: str, meter: PhaseMeter, phase: str) -> None:
    original = getattr(owner, name)

    def wrapped(*a, **k):
        with meter.phase(phase):
            return original(*a, **k)

    setattr(owner, name, wrapped)


def run_metered(report: Path, argv: list[str]) -> None:
    """Run post_train.py's, generate.py's or convert_authors_checkpoint.py's main in this process with the phases
    metered -> `report` (JSON)."""
    import importlib.util

    rank = os.environ.get("RANK")
    path = report if rank is None else report.with_name(f"{report.stem}.rank{rank}.json")
    meter = PhaseMeter(path=path, probe=rank is not None).start()  # ranks: the fsdp stage compares them
    script = Path(argv[0])
    spec = importlib.util.spec_from_file_location(script.stem, ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[script.stem] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    from sage_grpo.models import loading
    from sage_grpo.models.text_cache import TextEmbeddingCache

    _wrap(loading, "load_pipeline", meter, "load conditioning" if script.stem == "post_train" else "load")
    _wrap(TextEmbeddingCache, "precompute", meter, "text encoding")
    policy: dict = {}
    if script.stem == "post_train":
        _wrap(mod, "load_policy", meter, "load policy")
        load_policy = mod.load_policy

        def measured_load(*args, **kw):  # the policy's resident bytes: after its load less before it
            # anonymous memory, not RSS: the safetensors file stays mapped while any tensor of it lives (the bf16
            # embedders and norms), so RSS keeps every page the load touched, the quantized layers' bf16 pages too
            # (clean file pages the kernel reclaims under pressure; 19.8 GiB of RSS against 8.1 GiB of parameters at
            # the real size with --fp8_base)
            rss, anon = rss_bytes()
            transformer, trainable = load_policy(*args, **kw)
            rss_after, anon_after = rss_bytes()
            policy["policy_resident_gib"] = (anon_after - anon) / 2**30
            policy["policy_rss_gib"] = (rss_after - rss) / 2**30
            policy["policy_tensor_gib"] = policy_bytes(transformer) / 2**30
            return transformer, trainable

        mod.load_policy = measured_load
        _wrap(mod, "load_checkpoint", meter, "load checkpoint")
        _wrap(mod, "write_checkpoint", meter, "save")
        train = mod.train
        mod.train = lambda c, state, logger=None, **k: train(c, state, logger, hook=meter.phase, **k)
    elif script.stem == "generate":
        _wrap(loading, "load_transformer", meter, "load transformer")
    else:  # convert_authors_checkpoint.py
        from diffusers import DiffusionPipeline

        _wrap(DiffusionPipeline, "save_pretrained", meter, "write")
    t0 = time.perf_counter()
    with meter.phase("whole run"):
        mod.main(argv[1:])
    out = meter.report()
    out.update(policy)
    out["wall_s"] = time.perf_counter() - t0
    out["complete"] = True
    path.write_text(json.dumps(out, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------------ the stages


def run(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run `cmd` (output to `log`) -> seconds; a failure raises with the log's tail."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"[real_size_cpu] {' '.join(cmd[:4])} ... failed (exit {p.returncode}); {log}:\n{tail}")
    return time.perf_counter() - t0


def train_args(a, model: Path, out: Path, steps: int, *extra: str, authors_version: str = "",
               prompts: Path | None = None) -> list[str]:
    """post_train.py's arguments: a diffusers-layout `model`, or the authors' layout root `model` (its
    transformer/`authors_version`)."""
    where = (["--model_path", "", "--pretrained_model_root", str(model), "--pretrained_transformer_version",
              authors_version] if authors_version else ["--model_path", str(model), "--pretrained_model_root",
                                                        str(model.parent)])
    return ["post_train.py", "--config", "configs/tiny_cpu.yaml", *where, "--output_dir", str(out),
            "--train_video_csv", str(prompts or a.work / "prompts.txt"), "--dtype", "bf16", "--master_weight_type",
            "fp32",
            "--use_lora", "True", "--lora_r", "8", "--enable_gradient_checkpointing", "True",
            "--offload_text_encoder", "True", "--batch_size", "2", "--num_generations", "2",
            "--grpo_sampling_steps", "4", "--sample_n_frames", str(a.frames), "--height", str(a.size),
            "--width", str(a.size), "--max_steps", str(steps), "--save_interval", "1", "--log_interval", "1",
            "--validation_interval", "0", "--text_embedding_cache_dir", str(a.work / "text_cache"),
            "--cfg_scale", str(a.cfg_scale), "--threads", str(a.threads), "--fp8_base", str(a.fp8_base), *extra]


def metered(a, name: str, argv: list[str], torchrun: int = 0) -> dict:
    """Run `argv` metered in a fresh process (or `torchrun` ranks) -> its report(s) and wall time."""
    report = a.work / f"{name}.meter.json"
    inner = [str(ROOT / "scripts/real_size_cpu.py"), "--meter", str(report), "--", *argv]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(torchrun),
               "--master_port", str(29500 + os.getpid() % 1000), *inner]
    else:
        cmd = [sys.executable, *inner]
    t0 = time.perf_counter()
    failure = None
    try:
        run(cmd, a.work / f"{name}.log", env={"OMP_NUM_THREADS": str(a.threads)})
    except SystemExit as e:  # kept: how far it got and where the memory went is the measurement
        failure = str(e)
    wall = time.perf_counter() - t0
    if torchrun:
        files = [report.with_name(f"{report.stem}.rank{r}.json") for r in range(torchrun)]
        out = {"wall_s": wall, "ranks": [json.loads(f.read_text()) if f.is_file() else {} for f in files]}
    else:
        out = {"wall_s": wall, **(json.loads(report.read_text()) if report.is_file() else {})}
    if failure is not None:
        out["failed"] = failure[-2000:]
        print(f"[real_size_cpu] {name} failed: {failure[-600:]}", flush=True)
    return out


TENSOR_OWNERS = ("parameters", "gradients", "other tensors")


def rank_asymmetry(ranks: list[dict]) -> dict:
    """Per phase both ranks reached: the live tensor bytes (`live_tensor_bytes`, summed) and the peak anonymous
    memory of each rank (GiB), and the largest rank's excess over the smallest as a fraction of the smallest."""
    phases = [{p["phase"]: p for p in r.get("phases", [])} for r in ranks]
    out = {}
    for name in phases[0] if phases else {}:
        if not all(name in ph and ph[name].get("at_end_gib") for ph in phases):
            continue
        tensors = [sum(ph[name]["at_end_gib"][k] for k in TENSOR_OWNERS) for ph in phases]
        anon = [ph[name]["peak_anon_gib"] for ph in phases]
        out[name] = {"tensors_gib": tensors, "anon_gib": anon,
                     "tensors_excess": max(tensors) / max(min(tensors), 1e-9) - 1,
                     "anon_excess": max(anon) / max(min(anon), 1e-9) - 1}
    return out


def adapter(run_dir: Path, step: int):
    """{name: tensor} of the LoRA adapter the run saved at `step`."""
    from sage_grpo.models.lora import read_adapter

    return read_adapter(run_dir / f"checkpoint-{step}" / "lora")[1]


def max_abs_diff(x: dict, y: dict) -> tuple[float, float]:
    """(max |x - y| over every tensor, max |y|)."""
    if x.keys() != y.keys():
        raise SystemExit("[real_size_cpu] the two adapters have different tensors")
    diff = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
    return diff, max(float(y[k].float().abs().max()) for k in y)


def update_relative_l2(x: dict, y: dict) -> float:
    """||B_x - B_y|| / ||B_y|| over the adapters' B matrices: B starts at zero, so this compares the first updates
    themselves (A starts random and moves little, which would hide any difference)."""
    import torch

    keys = [k for k in y if "lora_B" in k]
    num = torch.sqrt(sum(((x[k].double() - y[k].double()) ** 2).sum() for k in keys))
    den = torch.sqrt(sum((y[k].double() ** 2).sum() for k in keys))
    return float(num / den)


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def check_resources(a, stages: list[str]) -> None:
    """Free disk and RAM against what the stages need: one line, before anything is written."""
    need_disk, need_ram = (1, 2) if a.miniature else (REAL_DISK_GIB, REAL_RAM_GIB)
    if not a.miniature and a.blocks != 54:
        need_disk = int(1.5 + 0.3 * a.blocks + (2.4 if a.real_vae else 0)) + 1  # 0.28 GiB a block, VAE 2.35
        need_ram = 8
    if (a.work / "checkpoint" / ".complete").is_file():
        need_disk = 1 if a.miniature else 4
    if "authors" in stages and not a.miniature:  # after the diffusers checkpoint is deleted, or beside it (--keep)
        authors = authors_disk_gib(a.authors_text_layers)
        need_disk, need_ram = need_disk + authors if a.keep else max(need_disk, authors), REAL_RAM_GIB
    a.work.mkdir(parents=True, exist_ok=True)
    disk = shutil.disk_usage(a.work).free / 2**30
    with open("/proc/meminfo") as f:
        ram = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) / 2**20
    line = (f"needs {need_disk} GiB free disk under {a.work} and {need_ram} GiB RAM; "
            f"has {disk:.0f} GiB free and {ram:.0f} GiB")
    if disk < need_disk or ram < need_ram:
        raise SystemExit(f"[real_size_cpu] {line}: not enough")
    print(f"[real_size_cpu] {line}", flush=True)


def stage_checkpoint(a, res: dict) -> None:
    from sage_grpo.models.full_size import (
        checkpoint_bytes,
        miniature_configs,
        real_configs,
        write_full_size_checkpoint,
    )

    ck = a.work / "checkpoint"
    if (ck / ".complete").is_file():
        print(f"[real_size_cpu] checkpoint: reusing {ck}", flush=True)
        res["checkpoint"] = json.loads((ck / ".complete").read_text())
        return
    shutil.rmtree(ck, ignore_errors=True)
    t0 = time.perf_counter()
    configs = None
    if a.miniature:
        configs = miniature_configs()
    elif a.blocks != 54:  # real width, fewer blocks; the miniature VAE and text encoders (whose widths it takes)
        configs = miniature_configs()
        latent = {} if a.real_vae else {"in_channels": 9, "out_channels": 4}  # the real ones: 2 x 32 + 1, 32
        configs["transformer"] = dict(real_configs()["transformer"], num_layers=a.blocks, text_embed_dim=64,
                                      text_embed_2_dim=32, image_embed_dim=32, **latent)
        if a.real_vae:
            configs["vae"] = real_configs()["vae"]
    write_full_size_checkpoint(ck, "480p_t2v", text_layers=a.text_layers, configs=configs,
                               max_shard_size="200KB" if a.miniature else "2GB",
                               log=lambda m: print(f"[real_size_cpu] {m.strip()}", flush=True))
    import resource

    info = {"seconds": time.perf_counter() - t0, "gib": checkpoint_bytes(ck) / 2**30,
            "writer_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    (ck / ".complete").write_text(json.dumps(info) + "\n")
    res["checkpoint"] = info


def stage_train(a, res: dict) -> None:
    out = a.work / "run_a"
    shutil.rmtree(out, ignore_errors=True)
    r = metered(a, "train", train_args(a, a.work / "checkpoint", out, 2))
    res["train"] = r
    if "failed" in r:
        raise SystemExit(f"[real_size_cpu] the training run failed; the later stages compare against it: {r['failed']}")
    steps = {row["step"]: row for row in metrics_rows(out) if "perf/step_s" in row}  # the last row of each step
    r["step_s"] = [steps[k]["perf/step_s"] for k in sorted(steps)]
    r["step_phases_s"] = [{p: steps[k].get(f"perf/{p}_s") for p in ("rollout", "reward", "anchor", "update",
                                                                    "optimizer")} for k in sorted(steps)]
    r["reward"] = [steps[k].get("reward/total_mean") for k in sorted(steps)]
    # the transformer's model FLOPs per second of each phase (sage_grpo.flops); MFU only with a device peak
    r["step_tflops"] = [{p: steps[k].get(f"perf/{p}_tflops") for p in FLOP_PHASES} for k in sorted(steps)]
    r["step_mfu"] = [{p: steps[k].get(f"perf/{p}_mfu") for p in FLOP_PHASES} for k in sorted(steps)]
    res["train"] = r


def stage_resume(a, res: dict) -> None:
    out = a.work / "run_b"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copytree(a.work / "run_a" / "checkpoint-1", out / "checkpoint-1")
    r = metered(a, "resume", train_args(a, a.work / "checkpoint", out, 2, "--resume_from_checkpoint", "latest"))
    res["resume"] = r
    if "failed" in r:
        return
    diff, scale = max_abs_diff(adapter(out, 2), adapter(a.work / "run_a", 2))
    moved, _ = max_abs_diff(adapter(a.work / "run_a", 2), adapter(a.work / "run_a", 1))
    r.update(max_abs_diff_vs_two_steps=diff, adapter_max_abs=scale, step2_change=moved, bitwise=diff == 0.0)
    res["resume"] = r


def stage_export(a, res: dict) -> None:
    ck = a.work / "run_a" / "checkpoint-2"
    ex = a.work / "export"
    shutil.rmtree(ex, ignore_errors=True)
    out: dict = {}
    for fmt in ("peft", "comfy"):
        t = run([sys.executable, "scripts/export_checkpoint.py", "--checkpoint", str(ck), "--out", str(ex / fmt),
                 "--lora_format", fmt], a.work / f"export_{fmt}.log")
        out[f"{fmt}_s"] = t
        out[f"{fmt}_files"] = sorted(p.name for p in (ex / fmt).iterdir())
    gen = metered(a, "generate", [
        "generate.py", "--config", "configs/tiny_cpu.yaml", "--model_path", str(a.work / "checkpoint"),
        "--pretrained_model_root", str(a.work), "--lora_path", str(ex / "peft"), "--prompt", PROMPTS[0],
        "--video_length", str(a.frames), "--fixed_size", f"{a.size}x{a.size}", "--num_inference_steps", "4",
        "--dtype", "bf16", "--cfg_scale", str(a.cfg_scale), "--offload_text_encoder", "True",
        "--output_path", str(ex / "videos"),
        "--text_embedding_cache_dir", str(a.work / "text_cache")])
    videos = sorted(str(p.relative_to(ex)) for p in (ex / "videos").rglob("*.mp4"))
    if not videos:
        raise SystemExit(f"[real_size_cpu] generate.py wrote no video under {ex / 'videos'}")
    out.update(generate=gen, videos=videos)
    res["export"] = out


def stage_fsdp(a, res: dict) -> None:
    out = a.work / "run_fsdp"
    shutil.rmtree(out, ignore_errors=True)
    # batch_size is per rank: 1 video a rank = the one-process run's group of 2, spread over the two ranks. The
    # rollout re-gathers each block per forward: kept gathered (the default, for GPUs) each rank holds the whole
    # 15.5 GiB bf16 transformer during the rollout, and two of them do not fit a 24 GiB host (measured: killed)
    r = metered(a, "fsdp", train_args(a, a.work / "checkpoint", out, 1, "--enable_fsdp", "True", "--batch_size", "1",
                                      "--rollout_reshard_after_forward", "True", "--threads", "1"), torchrun=2)
    r["rank_asymmetry"] = rank_asymmetry(r["ranks"])
    res["fsdp"] = r
    if "failed" in r or not (a.work / "run_a" / "checkpoint-1").is_dir():
        return
    sharded, one = adapter(out, 1), adapter(a.work / "run_a", 1)
    diff, scale = max_abs_diff(sharded, one)
    r.update(max_abs_diff_vs_one_process=diff, adapter_max_abs=scale,
             update_relative_l2=update_relative_l2(sharded, one))
    res["fsdp"] = r


def stage_planner(a, res: dict) -> None:
    args = train_args(a, a.work / "checkpoint", a.work / "plan", 2)[1:]  # the training run's flags
    log = a.work / "planner.log"
    run([sys.executable, "scripts/plan_memory.py", *args, "--world_size", "1", "--json"], log)
    res["planner"] = json.loads(log.read_text()[log.read_text().index("{"):])


def stage_block(a, res: dict) -> None:
    out = a.work / "block"
    out.mkdir(parents=True, exist_ok=True)
    f, h = (a.frames - 1) // 4 + 1, a.size // 16
    cmd = [sys.executable, "scripts/bench_attention.py", "--latent", f"{f},{h},{h}", "--dtype", "bf16",
           "--mllm_valid", "8,5", "--byt5_valid", "1,1", "--reps", "3", "--out", str(out)]
    if a.miniature:
        cmd += ["--heads", "2", "--head_dim", "32"]
    run(cmd, a.work / "block.log", env={"OMP_NUM_THREADS": str(a.threads)})
    res["block"] = json.loads((out / "bench_attention.json").read_text())


def authors_prompts(a, version: str) -> Path:
    """The prompt file of the authors stage: the two prompts, each with a reference image for an I2V version."""
    from sage_grpo.models.tiny import variant_of

    if variant_of(version).task != "i2v":
        return a.work / "prompts.txt"
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, a.size, dtype=np.uint8)
    rgb = np.stack([np.tile(ramp, (a.size, 1)), np.tile(ramp[:, None], (1, a.size)), np.full((a.size,) * 2, 90,
                                                                                              np.uint8)], -1)
    Image.fromarray(rgb).save(a.work / "reference.png")
    path = a.work / "authors_prompts.csv"
    path.write_text("prompt,ref_image_path\n" + "".join(f"{p},reference.png\n" for p in PROMPTS))
    return path


def check_converted(folder: Path, seed: int = 0) -> dict:
    """Every tensor of the converted diffusers-layout checkpoint against the values the authors' layout was written
    with (sage_grpo.models.full_size.expected_tensor, drawn in bf16) -> counts per component."""
    import torch
    from safetensors import safe_open

    from sage_grpo.models.full_size import expected_tensor

    out = {}
    for component in ("transformer", "vae", "text_encoder", "image_encoder"):
        files = sorted((folder / component).glob("*.safetensors"))
        if not files:
            continue
        n = unequal = elements = 0
        for f in files:
            with safe_open(str(f), "pt") as h:
                for key in h.keys():
                    t = h.get_tensor(key)
                    want = expected_tensor(component, key, torch.empty(t.shape, device="meta"), seed)
                    n, elements = n + 1, elements + t.numel()
                    unequal += not torch.equal(t, want.to(t.dtype))
        out[component] = {"tensors": n, "parameters": elements, "unequal": unequal}
    return out


def stage_authors(a, res: dict) -> None:
    from sage_grpo.models.full_size import checkpoint_bytes, miniature_configs, real_configs, write_authors_checkpoint

    root, conv, version = a.work / "authors", a.work / "authors_converted", a.authors_version
    for d in (root, conv, a.work / "run_authors"):
        shutil.rmtree(d, ignore_errors=True)
    need = 1 if a.miniature else authors_disk_gib(a.authors_text_layers)
    free = shutil.disk_usage(a.work).free / 2**30
    print(f"[real_size_cpu] authors: needs {need} GiB free disk, has {free:.0f} GiB", flush=True)
    if free < need:
        raise SystemExit("[real_size_cpu] authors: not enough disk (fewer Qwen layers: --authors_text_layers; "
                         "without --keep the diffusers checkpoint is deleted before this stage)")
    out: dict = {"version": version}
    res["authors"] = out
    configs = miniature_configs(version) if a.miniature else real_configs(version, a.authors_text_layers)
    # The I2V bucket base (config only: no weight depends on it): --size, so the reference image's bucket is the
    # T2V runs' size instead of 640 x 640 (1,600 latent tokens a frame, hours a step on a CPU)
    configs["transformer"]["target_size"] = a.size
    out["target_size"] = a.size
    t0 = time.perf_counter()
    write_authors_checkpoint(root, version, configs=configs,
                             max_shard_size="200KB" if a.miniature else "2GB",
                             log=lambda m: print(f"[real_size_cpu] {m.strip()}", flush=True))
    out.update(write_s=time.perf_counter() - t0, gib=checkpoint_bytes(root) / 2**30)
    out["train"] = metered(a, "authors_train", train_args(a, root, a.work / "run_authors", 1,
                                                          authors_version=version, prompts=authors_prompts(a, version)))
    out["convert"] = metered(a, "authors_convert", [
        "scripts/convert_authors_checkpoint.py", "--pretrained_model_root", str(root),
        "--pretrained_transformer_version", version, "--out", str(conv)])
    if "failed" not in out["convert"]:
        t0 = time.perf_counter()
        out["converted_gib"] = checkpoint_bytes(conv) / 2**30
        out["check"] = check_converted(conv)
        out["check_s"] = time.perf_counter() - t0
    if not a.keep:
        for d in (root, conv):
            shutil.rmtree(d, ignore_errors=True)
    for part in ("train", "convert"):
        if "failed" in out[part]:
            raise SystemExit(f"[real_size_cpu] authors: {part} failed: {out[part]['failed'][-600:]}")
    bad = {k: v for k, v in out["check"].items() if v["unequal"]}
    if bad:
        raise SystemExit(f"[real_size_cpu] authors: the converted checkpoint differs from what was written: {bad}")


# ------------------------------------------------------------------------------------------------------ report


FLOP_PHASES = ("rollout", "anchor", "update", "step")


def flops_table(train: dict) -> list[str]:
    """The training run's transformer TFLOP/s (and MFU where the run had a peak) per step and phase."""
    if not train.get("step_tflops"):
        return []

    def cell(tflops, mfu):
        if tflops is None:
            return "-"
        return f"{tflops:.4g}" + (f" ({mfu:.1%} MFU)" if mfu is not None else "")

    lines = ["", "The training run's transformer TFLOP/s per step (model FLOPs of sage_grpo.flops over the phase's "
             "seconds; MFU needs a device peak, none on the CPU):", "",
             "| step | " + " | ".join(FLOP_PHASES) + " |", "|---|" + "---|" * len(FLOP_PHASES)]
    for i, (tf, mf) in enumerate(zip(train["step_tflops"], train.get("step_mfu") or [{}] * len(train["step_tflops"])),
                                 start=1):
        lines.append(f"| {i} | " + " | ".join(cell(tf.get(p), mf.get(p)) for p in FLOP_PHASES) + " |")
    return lines


def table(res: dict) -> str:
    lines = ["| run | phase | peak RSS GiB | of it anonymous GiB | seconds |", "|---|---|---|---|---|"]

    def rows(name: str, phases: list) -> None:
        for p in phases:
            anon = f"{p['peak_anon_gib']:.2f}" if "peak_anon_gib" in p else "-"
            lines.append(f"| {name} | {p['phase']} | {p['peak_rss_gib']:.2f} | {anon} | {p['seconds']:.0f} |")

    for name in ("train", "resume"):
        rows(name, res.get(name, {}).get("phases", []))
    for r, rank in enumerate(res.get("fsdp", {}).get("ranks", [])):
        rows(f"fsdp rank {r}", rank.get("phases", []))
    rows("generate (LoRA export)", res.get("export", {}).get("generate", {}).get("phases", []))
    authors = res.get("authors", {})
    rows(f"authors' layout {authors.get('version', '')}", authors.get("train", {}).get("phases", []))
    rows("convert_authors_checkpoint", authors.get("convert", {}).get("phases", []))
    resident, planned = res.get("train", {}).get("policy_resident_gib"), res.get("planner", {}).get("terms_gib", {})
    if resident is not None and planned.get("policy weights") and not res["miniature"]:  # the plan is the real size
        plan, storage = planned["policy weights"], res["train"]["policy_tensor_gib"]
        lines += ["", f"policy after its load{' (FP8 base)' if res['settings'].get('fp8_base') else ''}: anonymous "
                  f"memory {resident:.2f} GiB more than before it (RSS {res['train'].get('policy_rss_gib', 0):.2f}, "
                  f"mapped file pages included), its parameter storage {storage:.2f} GiB; planned {plan:.2f} GiB "
                  f"(anonymous {resident / plan - 1:+.1%})"]
    lines += flops_table(res.get("train", {}))
    ranks = res.get("fsdp", {}).get("ranks", [])
    if ranks:
        keys = [*TENSOR_OWNERS, "heap", "anonymous mappings", "written file pages", "safetensors file pages",
                "malloc free in arenas"]
        lines += ["", "What is alive at each phase's end on each FSDP2 rank (GiB):", "",
                  "| rank | phase | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for r, rank in enumerate(ranks):
            for p in rank.get("phases", []):
                if p.get("at_end_gib"):
                    cells = " | ".join(f"{p['at_end_gib'].get(k, 0):.2f}" for k in keys)
                    lines.append(f"| {r} | {p['phase']} | {cells} |")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=ROOT / "outputs/real_size", help="working folder (checkpoint, runs)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--miniature", action="store_true", help="miniature configs of the same components (the test)")
    p.add_argument("--text_layers", type=int, default=28, help="Qwen text tower depth (28 = the real 7B)")
    p.add_argument("--authors_text_layers", type=int, default=12, help="Qwen text tower depth of the authors stage: "
                   "its layout and the converted copy are on disk together (12: 56 GiB; 28: 70 GiB)")
    p.add_argument("--blocks", type=int, default=54, help="transformer blocks at the real width (54 = the real 8.3B; "
                   "fewer: with the miniature VAE and text encoders, e.g. 8 for a 1.36B model two ranks hold on a "
                   "24 GiB host)")
    p.add_argument("--real_vae", action="store_true", help="with --blocks below 54: the real VAE (1.26B) instead "
                   "of the miniature one")
    p.add_argument("--frames", type=int, default=5, help="video frames (5 -> 2 latent frames)")
    p.add_argument("--size", type=int, default=64, help="video height and width in pixels (64 -> 4 x 4 latent)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the one-process runs")
    p.add_argument("--cfg_scale", type=float, default=1.0, help="CFG of the runs (1 = off: half the transformer work "
                   "of the checkpoint's 6; a 2-core CPU takes ~16 min a step with it)")
    p.add_argument("--fp8_base", action="store_true", help="the runs on an FP8 frozen base (post_train.py --fp8_base): "
                   "the table sets the policy's resident bytes after its load against the planner's; the fsdp stage "
                   "shards the FP8 base over its two ranks")
    p.add_argument("--authors_version", default="480p_i2v", help="the version the authors stage writes, trains "
                   "and converts (an I2V one also exercises SigLIP and the reference image at the real size)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: deleted when done with)")
    p.add_argument("--meter", type=Path, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    if a.meter is not None:
        rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
        return run_metered(a.meter, rest)
    stages = [s for s in a.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise SystemExit(f"[real_size_cpu] unknown stage(s) {unknown}; valid: {','.join(STAGES)}")
    a.work = a.work.resolve()
    # the stages reuse the checkpoint in --work and compare with its runs: those of other settings would mislead
    settings = {k: getattr(a, k) for k in SETTINGS}
    report = a.work / "real_size_cpu.json"
    earlier = json.loads(report.read_text()) if report.is_file() else {}
    other = {k: v for k, v in earlier.get("settings", settings).items() if settings.get(k) != v}
    if other:
        raise SystemExit(f"[real_size_cpu] {a.work} holds a checkpoint and runs made with other settings ("
                         + ", ".join(f"{k} {v} where this run has {settings.get(k)}" for k, v in other.items())
                         + "): pass another --work, or delete that folder")
    if set(stages) & {"train", "resume", "export", "fsdp"}:
        stages.append("checkpoint")  # written when missing, else reused
    if set(stages) & {"resume", "export"} and not (a.work / "run_a" / "checkpoint-2").is_dir():
        stages.append("train")  # what they compare against (fsdp compares when it is there, else measures the ranks)
    check_resources(a, stages)
    (a.work / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    res: dict = {"machine": {"cpus": os.cpu_count()}, "miniature": a.miniature, "text_layers": a.text_layers,
                 "settings": settings}
    res.update({k: v for k, v in earlier.items() if k not in res})
    for stage in STAGES:
        if stage == "authors" and not a.keep:  # its disk: the diffusers checkpoint is done with by now
            shutil.rmtree(a.work / "checkpoint", ignore_errors=True)
        if stage in stages:
            print(f"[real_size_cpu] stage {stage}", flush=True)
            t0 = time.perf_counter()
            globals()[f"stage_{stage}"](a, res)
            print(f"[real_size_cpu] stage {stage} done in {time.perf_counter() - t0:.0f} s", flush=True)
            report.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    print(f"[real_size_cpu] report: {report}")
    if not a.keep:
        shutil.rmtree(a.work / "checkpoint", ignore_errors=True)


if __name__ == "__main__":
    main()
