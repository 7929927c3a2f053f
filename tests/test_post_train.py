"""post_train.py end to end on the tiny HunyuanVideo-1.5 (CPU): outputs, exact resume, KL variants, samplers,
anchor cadence, gradient independence of the micro-batch size, accumulation, crash recovery."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest
import torch
import yaml
from post_train_helpers import ROOT, _args, _stable, _weights, pt

from sage_grpo.checkpoint import list_checkpoints
from sage_grpo.errors import SageGRPOError
from sage_grpo.metrics import read_metrics


def _fresh_train_state():
    from sage_grpo.config import Config
    from sage_grpo.data import GroupSampler
    from sage_grpo.kl import AdaptiveKLController

    return pt.TrainState(controller=AdaptiveKLController.from_config(Config().kl),
                         sampler=GroupSampler(8, batch_size=4, num_generations=2, dp_size=1, seed=0))


def test_train_state_restores_every_field():
    """Every field of TrainState survives train_state.json: each is set unlike a fresh state's, saved through JSON
    and loaded into a fresh state (a field that save or load forgot stays at its fresh value and fails here)."""
    from dataclasses import fields

    a = _fresh_train_state()
    for i, f in enumerate(fields(a), start=1):
        value = getattr(a, f.name)
        if isinstance(value, bool):
            setattr(a, f.name, not value)
        elif isinstance(value, (int, float)):
            setattr(a, f.name, type(value)(value + 3 * i) + (0.25 if isinstance(value, float) else 0))
        elif f.name == "controller":
            for kl in (1e-3, 2e-3, 5e-2):
                value.update(kl)
        elif f.name == "sampler":
            for _ in range(3):
                value.next_step()
        elif isinstance(value, dict):  # val_first, hacking_warned
            value.update({f"metric{i}": [0.5 * i, 0.25], "saturation": 4})
        else:
            raise AssertionError(f"TrainState.{f.name}: no test value for its type, add one here")
    b = _fresh_train_state()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    fresh = _fresh_train_state().state_dict()
    for f in fields(a):
        assert a.state_dict()[f.name] != fresh[f.name], f.name  # the test value really differs
        assert b.state_dict()[f.name] == a.state_dict()[f.name], f.name
    with pytest.raises(SageGRPOError, match="older sage-grpo"):
        b.load_state_dict({k: v for k, v in a.state_dict().items() if k != "accum_rounds"})


def test_a_run_that_fails_in_setup_leaves_no_output_folder(tiny_model, tmp_path):
    """A failure once the workers set up (here a reward that cannot be built; preflight only imports it) leaves no
    --output_dir behind: the folder is made by the run's first file."""
    plugin = tmp_path / "failing_reward.py"
    plugin.write_text("from sage_grpo.errors import SageGRPOError\n\n\ndef make(**_):\n"
                      "    raise SageGRPOError('the reward server is down')\n")
    with pytest.raises(SageGRPOError, match="the reward server is down"):
        pt.main(_args(tiny_model, tmp_path / "outputs" / "lora", "--reward_model", f"{plugin}:make"))
    assert not (tmp_path / "outputs").exists()


def test_two_steps_write_everything_and_train(tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, "--validation_interval", "2", "--validation_num_inference_steps", "2",
                  "--validate_video_length", "5", "--peak_tflops", "0.5"))
    # not a terminal: one compact line per step with the live numbers, no progress-bar redraws, no library noise
    shown = capsys.readouterr()
    for step in (1, 2):
        assert re.search(rf"\[post_train\] step {step}/2  reward 0\.\d{{4}}  kl \d\.\d\de[+-]\d\d  clip \d\.\d{{3}}  "
                         r"s/step \d+\.\d\d  TFLOP/s \d\.\d+(e-\d\d)?  MFU \d+\.\d%", shown.out), shown.out
    assert "\r" not in shown.err and "it/s" not in shown.err and "torch.distributed is disabled" not in shown.err
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k, v in r.items():
            assert v is not None and (not isinstance(v, float) or math.isfinite(v)), (k, v)
    assert rows[0]["train/ratio_min"] == rows[0]["train/ratio_max"] == 1.0  # re-scored in the rollout's chunks
    for r in rows:  # the transformer's model FLOPs per phase, their rate and MFU against --peak_tflops
        for phase in ("rollout", "update", "step"):
            assert r[f"perf/{phase}_tflop"] > 0
            assert r[f"perf/{phase}_tflops"] == pytest.approx(r[f"perf/{phase}_tflop"] / r[f"perf/{phase}_s"])
            assert r[f"perf/{phase}_mfu"] == pytest.approx(r[f"perf/{phase}_tflops"] / 0.5)
        assert "perf/reward_tflop" not in r
    assert rows[1]["perf/validation_tflop"] > 0
    assert rows[1]["val/videos"] == 4
    assert (out / "curves.png").stat().st_size > 0 and (out / "config.yaml").is_file()
    videos = sorted((out / "samples" / "step_000002").glob("*.mp4"))
    assert len(videos) == 4 and all(v.with_suffix(".txt").is_file() for v in videos)
    assert [s for s, _ in list_checkpoints(out)] == [2]  # the final checkpoint
    saved = json.loads((list_checkpoints(out)[-1][1] / "train_state.json").read_text())
    assert saved.keys() >= pt.TrainState.__dataclass_fields__.keys()
    from sage_grpo.models.loading import load_pipeline

    base = load_pipeline(model_path=str(tiny_model), dtype="fp32", load_text_encoders=False).transformer.state_dict()
    trained = _weights(out)
    changed = [k for k in base if not torch.equal(base[k], trained[k])]
    assert len(changed) > len(base) // 2


def test_tensorboard_gets_the_scalars_the_validation_videos_and_the_config(tiny_model, tmp_path):
    """The default sink, as a run writes it, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sage_grpo.video import read_video

    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, "--max_steps", "1", "--report_to", "tensorboard", "--validation_interval", "1",
                  "--validation_num_inference_steps", "2", "--validate_video_length", "5"))
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    row = read_metrics(out / "metrics.jsonl")[0]
    scalars = [(e.step, e.value) for e in acc.Scalars("reward/total_mean")]
    assert scalars == [(1, pytest.approx(row["reward/total_mean"]))]
    assert [e.step for e in acc.Scalars("val/reward_total")] == [1]
    videos = sorted((out / "samples" / "step_000001").glob("*.mp4"))
    assert len(videos) == 4
    for path in videos:
        frames, _ = read_video(path)  # [5, 3, H, W]
        (img,) = acc.Images(f"samples/{path.stem}")
        assert (img.step, img.height, img.width) == (1, frames.shape[2], 5 * frames.shape[3])  # frames side by side
    (text,) = acc.Tensors("config/text_summary")
    assert f"output_dir: {out}" in text.tensor_proto.string_val[0].decode()


HACK = ("--kl_weight", "0", "--validate_at_step0", "--validation_interval", "2", "--validation_num_inference_steps",
        "4", "--validate_video_length", "5")  # with tiny_cpu.yaml's brightness reward: a run built to hack


def _warned(text: str) -> list[str]:
    return re.findall(r"possible reward hacking at step \d+: .* while held-out (\w+) (?:fell|rose)", text)


@pytest.mark.slow
def test_validation_reports_held_out_metrics_and_warns_on_a_brightness_hack(tiny_model, tmp_path, capsys):
    """The brightness reward with KL off, validated before the first update and after step 2: the videos get
    brighter and greyer, flatter and stiller; validation reports the held-out metrics beside the reward
    (metrics.jsonl, samples' JSON, curves.png), the check warns once per metric that fell, and the warnings are kept
    in the checkpoint's train state. The `color` reward is named as a validation-only metric."""
    import matplotlib.pyplot as plt

    from sage_grpo.metrics import curves_figure

    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, *HACK, "--validation_metrics", "auto", "color"))
    shown = capsys.readouterr().out
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(rows) == [0, 1, 2]
    held = ["color", "saturation", "contrast", "motion", "drift"]  # color, auto less brightness (trained)
    assert sorted(k for k in rows[0] if k.startswith("val/")) == sorted(
        ["val/reward_total", "val/videos", "val/hacking_warnings", *[f"val/{k}" for k in held]])
    assert rows[0]["val/drift"] == 0.0 and rows[0]["val/hacking_warnings"] == 0
    assert all(v == 0.0 for k, v in rows[0].items() if k.startswith("val_shift/"))
    assert "val/saturation" not in rows[1]  # validation steps only
    after = rows[2]
    assert after["val/reward_total"] > rows[0]["val/reward_total"] and after["val_shift/reward_total"] > 1.0
    assert after["val/drift"] > 0.0 and after["val/saturation"] < rows[0]["val/saturation"]

    warned = _warned(shown)
    assert "saturation" in warned and len(warned) == len(set(warned)) == after["val/hacking_warnings"]
    assert all(after[f"val_shift/{m}"] < -1.0 for m in warned)  # each fell by more than the default 1 spread
    assert "held-out metrics moved the wrong way while the trained reward rose" in shown  # the end-of-run summary
    state = json.loads((list_checkpoints(out)[-1][1] / "train_state.json").read_text())
    assert state["hacking_warned"] == dict.fromkeys(warned, 2)
    assert state["val_first"]["reward_total"][0] == pytest.approx(rows[0]["val/reward_total"])
    assert len(list((out / "validation_reference").glob("*.safetensors"))) == 4
    meta = json.loads(next((out / "samples" / "step_000002").glob("*_config.json")).read_text())
    assert sorted(meta["heldout"]) == sorted(held)
    fig = curves_figure(list(rows.values()))
    try:
        labels = [ln.get_label() for ln in fig.axes[-1].lines]
        assert {"trained reward", "saturation", "contrast", "motion", "hacking warning"} <= set(labels)
    finally:
        plt.close(fig)
    assert (out / "curves.png").stat().st_size > 0


@pytest.mark.slow
def test_hacking_warnings_and_baseline_survive_a_resume(tiny_model, tmp_path, capsys):
    """Resumed after the warnings of step 2, the run keeps its step-0 baseline and drift references and does not
    warn again about the metrics it warned about, though they keep falling."""
    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, *HACK, "--save_interval", "2"))
    first = _warned(capsys.readouterr().out)
    assert first
    pt.main(_args(tiny_model, out, *HACK, "--save_interval", "2", "--max_steps", "4", "--resume_from_checkpoint",
                  "latest"))
    again = _warned(capsys.readouterr().out)
    assert not set(again) & set(first)
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert rows[4]["val_shift/reward_total"] > rows[2]["val_shift/reward_total"]  # still against step 0
    assert rows[4]["val/drift"] > rows[2]["val/drift"] > 0  # the references were read back
    assert rows[4]["val/hacking_warnings"] == len(first) + len(again)
    assert all(rows[4][f"val_shift/{m}"] < rows[2][f"val_shift/{m}"] for m in first)  # still falling, not re-warned


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_resume_is_exact(tiny_model, tmp_path, lora):
    extra = ["--update_ref_model_step", "1", "--kl_warmup_updates", "1", "--kl_weight", "1e-2", "--kl_coef", "1e-3",
             "--kl_min_coef", "1e-4", "--learning_rate", "1e-3"]
    if lora:
        extra += ["--use_lora", "--lora_r", "4", "--lora_alpha", "8"]
    full, half = tmp_path / "full", tmp_path / "half"
    pt.main(_args(tiny_model, full, "--max_steps", "4", *extra))
    pt.main(_args(tiny_model, half, "--max_steps", "4", "--save_interval", "2", *extra, "--max_steps", "2"))
    pt.main(_args(tiny_model, half, "--max_steps", "4", "--save_interval", "2", *extra,
                  "--resume_from_checkpoint", "latest"))
    a, b = (list_checkpoints(d)[-1][1] for d in (full, half))
    sa, sb = (json.loads((p / "train_state.json").read_text()) for p in (a, b))
    assert sa["step"] == sb["step"] == 4
    assert {k: v for k, v in sa.items() if k != "config"} == {k: v for k, v in sb.items() if k != "config"}
    wa, wb = _weights(full), _weights(half)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _stable(read_metrics(full / "metrics.jsonl")) == _stable(read_metrics(half / "metrics.jsonl"))
    # optimizer state: compare the DCP shards byte for byte through a fresh load
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for p in (a, b):
        dcp_to_torch_save(p / "optimizer", p / "opt.pt")
    oa, ob = (torch.load(p / "opt.pt", weights_only=True)["optimizer"]["state"] for p in (a, b))
    assert oa.keys() == ob.keys() and len(oa) > 0
    for k in oa:
        for name in oa[k]:
            assert torch.equal(torch.as_tensor(oa[k][name]), torch.as_tensor(ob[k][name])), (k, name)


@pytest.mark.slow
@pytest.mark.parametrize("variant,flags", [
    ("none", ["--kl_weight", "0"]),
    ("fixed", ["--use_moving_KL", "False", "--use_dual_kl", "False"]),
    ("moving", ["--use_dual_kl", "False"]),
    ("stepwise", ["--use_dual_kl", "--dual_kl_moving_weight", "0"]),
    ("dual", []),
    ("dual_training_phase", ["--kl_compute_mode", "training_phase", "--reference_mode_offload"]),
])
def test_kl_variants_run(tiny_model, tmp_path, variant, flags):
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "3", "--update_ref_model_step", "2", *flags))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    has_pos = variant in ("fixed", "moving", "dual", "dual_training_phase")
    assert ("kl/pos" in rows[-1]) == has_pos
    assert ("kl/vel" in rows[-1]) == (variant in ("stepwise", "dual", "dual_training_phase"))
    assert ("kl/coef" in rows[-1]) == (variant != "none")
    if has_pos:
        assert rows[0]["kl/pos"] == 0.0  # the anchor is the rollout policy at step 1
        assert rows[1]["kl/pos"] > 0  # one update later it is not


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["dance_grpo", "flow_grpo", "sage_grpo", "cps"])
def test_every_sampler_trains(tiny_model, tmp_path, sampler):
    pt.main(_args(tiny_model, tmp_path, "--sde_type", sampler, "--max_steps", "1"))
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["train/ratio_min"] == row["train/ratio_max"] == 1.0 and row["train/grad_norm"] > 0


def _count_calls(monkeypatch):
    """Record, per step, the anchor's per-sample forwards (a hook on the anchor model: the count is independent of
    the loop's own bookkeeping) in the rollout-phase precompute and in the update."""
    calls, forwards, hooked = [], [0], set()

    def count(module, args, kwargs):
        forwards[0] += int(kwargs.get("hidden_states", args[0] if args else None).shape[0])

    def hook(c):
        if id(c.anchor.model) not in hooked:
            hooked.add(id(c.anchor.model))
            c.anchor.model.register_forward_pre_hook(count, with_kwargs=True)

    orig_update = pt.backward_phase

    def spy(c, state, *a, **k):
        hook(c)
        before = forwards[0]
        out = orig_update(c, state, *a, **k)
        calls.append((state.step, state.anchor_refreshed_at, forwards[0] - before))
        return out

    orig_anchor = pt.anchor_means

    def spy_anchor(c, state, *a, **k):
        hook(c)
        before = forwards[0]
        out = orig_anchor(c, state, *a, **k)
        calls.append(("rollout_phase", state.step, forwards[0] - before))
        return out

    monkeypatch.setattr(pt, "backward_phase", spy)
    monkeypatch.setattr(pt, "anchor_means", spy_anchor)
    return calls


@pytest.mark.slow
def test_anchor_refresh_cadence_and_skipped_forwards(tiny_model, tmp_path, monkeypatch):
    calls = _count_calls(monkeypatch)
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "5", "--update_ref_model_step", "2"))
    pre = [c[2] for c in calls if c[0] == "rollout_phase"]
    refreshed = [c[1] for c in calls if c[0] != "rollout_phase"]
    # refreshes before steps 3 and 5 (after updates 2 and 4): the anchor equals the rollout policy at steps 1, 3, 5
    assert refreshed == [0, 0, 2, 2, 4]
    pairs = 4 * 4 * 2  # batch 4 x ceil(4 steps * 1.0), CFG: conditional and unconditional rows in one forward
    assert pre == [0, pairs, 0, pairs, 0]
    assert [c[2] for c in calls if c[0] != "rollout_phase"] == [0] * 5  # the update never runs the anchor itself


@pytest.mark.slow
def test_gradient_does_not_depend_on_micro_batch_size(tiny_model, tmp_path, monkeypatch):
    grads = {}

    def capture(c, state):
        grads[c.cfg.optim.mini_batch_size_per_update] = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                                         for p in c.trainable]
        c.optimizer.zero_grad()
        state.accum_rounds, state.pending_kl_sum, state.pending_kl_pairs = 0, 0.0, 0
        return {}

    import sage_grpo.rollout as rollout_mod

    real_rollout = rollout_mod.rollout

    def one_chunk(*a, **k):  # the same rollout for every micro-batch size: only the update's split differs
        return real_rollout(*a, **{**k, "chunk_size": 0})

    monkeypatch.setattr(pt, "optimizer_step", capture)
    monkeypatch.setattr(rollout_mod, "rollout", one_chunk)
    for mb in (1, 2, 4):
        pt.main(_args(tiny_model, tmp_path / str(mb), "--max_steps", "1", "--mini_batch_size_per_update", str(mb)))
    for mb in (2, 4):
        for g1, g2 in zip(grads[1], grads[mb]):
            torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5 * float(g1.abs().max()) + 1e-12)
    assert any(float(g.abs().max()) > 0 for g in grads[1])


@pytest.mark.slow
def test_accumulation_counts_updates(tiny_model, tmp_path):
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "4", "--gradient_accumulation_steps", "2",
                  "--update_ref_model_step", "2", "--kl_warmup_updates", "4"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["train/updates"] for r in rows] == [0, 1, 1, 2]
    assert ["train/grad_norm" in r for r in rows] == [False, True, False, True]
    # the refresh counts updates: the first is due after update 2 (step 5), not after 2 rounds
    assert [r["kl/anchor_synced"] for r in rows] == [1, 1, 0, 0]
    # the KL coefficient warms up per update: 1e-7 + (1e-5 - 1e-7) * k / 4 for updates k = 0, 1
    assert rows[1]["kl/coef"] == pytest.approx(1e-7) and rows[3]["kl/coef"] == pytest.approx(1e-7 + 9.9e-6 / 4)


def test_killed_run_resumes_from_its_last_checkpoint(tiny_model, tmp_path, monkeypatch):
    orig = pt.backward_phase

    def crash(c, state, *a, **k):
        if state.step == 2:  # the third step dies after checkpoint-2
            raise KeyboardInterrupt
        return orig(c, state, *a, **k)

    monkeypatch.setattr(pt, "backward_phase", crash)
    with pytest.raises(KeyboardInterrupt):
        pt.main(_args(tiny_model, tmp_path, "--max_steps", "4", "--save_interval", "2"))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    monkeypatch.setattr(pt, "backward_phase", orig)
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "4", "--save_interval", "2",
                  "--resume_from_checkpoint", "latest"))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]


def _load_script(name, path):
    """A script of the repository (generate.py, scripts/export_checkpoint.py) as a module, to call its main()."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_generate_loads_a_checkpoint_and_its_export_alike_with_the_usual_file_modes(tiny_model, tmp_path):
    """Train 1 step, export: generate.py --checkpoint_path takes the exported folder, checkpoint-N and
    checkpoint-N/transformer and makes the same video from each (the trained one, not the base model's); what the
    run and the export wrote is readable by others (safetensors alone writes 0600)."""
    import stat

    from sage_grpo.files import umask

    generate = _load_script("generate", ROOT / "generate.py")
    export = _load_script("export", ROOT / "scripts/export_checkpoint.py")
    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, "--max_steps", "1", "--learning_rate", "1e-2"))
    ckpt = list_checkpoints(out)[-1][1]
    export.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "exp")])
    videos = {}
    for name, extra in (("base", []), ("dcp", ["--checkpoint_path", str(ckpt / "transformer")]),
                        ("checkpoint", ["--checkpoint_path", str(ckpt)]),
                        ("export", ["--checkpoint_path", str(tmp_path / "exp")])):
        [path] = generate.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model_path", str(tiny_model),
                                "--prompt", "a red ball rolls", "--video_length", "5", "--num_inference_steps", "2",
                                "--output_path", str(tmp_path / f"{name}.mp4"), *extra])
        videos[name] = path.read_bytes()
    assert videos["dcp"] == videos["checkpoint"] == videos["export"] != videos["base"]

    mask = umask()
    for p in tmp_path.rglob("*"):  # the run, its checkpoint, the export, the videos (pytest made tmp_path 0700)
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))
    assert (tmp_path / "exp" / "diffusion_pytorch_model.safetensors").is_file()


def test_help_shows_the_examples_one_per_line_and_nothing_about_the_files_layout(capsys):
    """--help's description is the docstring with its lines kept: each launch example on a line of its own (argparse's
    default formatter ran them into one paragraph); the notes on how the file reads are for its readers."""
    with pytest.raises(SystemExit) as exc:
        pt.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    lines = out.splitlines()
    for example in ("python post_train.py --config configs/tiny_cpu.yaml", "torchrun --nproc_per_node 8 post_train.py",
                    "bash run_post_train.sh", "NNODES=8 NODE_RANK=... MASTER_ADDR=..."):
        assert any(line.strip().startswith(example) for line in lines), example
    assert "reads in run order" not in out and "--resume_from_checkpoint" in out


def test_user_errors_before_any_model_loads(tmp_path):
    with pytest.raises(SageGRPOError, match="sp_size 2 must divide the world size 1"):
        pt.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--sp_size", "2", "--num_generations", "2",
                 "--output_dir", str(tmp_path)])
    with pytest.raises(SageGRPOError, match="mini_batch_size_per_update"):
        pt.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--mini_batch_size_per_update", "3",
                 "--output_dir", str(tmp_path)])
    with pytest.raises(SageGRPOError, match="not a complete checkpoint"):
        pt.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--resume_from_checkpoint", str(tmp_path),
                 "--output_dir", str(tmp_path)])
    with pytest.raises(SageGRPOError, match="validation_metrics world needs world captions"):
        pt.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--validation_metrics", "world",
                 "--output_dir", str(tmp_path)])
    with pytest.raises(SageGRPOError, match="hacking_metric_drop must be > 0"):
        pt.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--hacking_metric_drop", "0",
                 "--output_dir", str(tmp_path)])
    with pytest.raises(SageGRPOError, match="--max_steps must be >= 1, got 0"):  # no folder a next launch refuses
        pt.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--max_steps", "0",
                 "--output_dir", str(tmp_path / "zero")])
    assert not (tmp_path / "zero").exists()


@pytest.mark.slow
def test_a_lora_checkpoint_exports_for_from_pretrained_and_generates_the_trained_video(tiny_model, tmp_path):
    """Train 1 LoRA step: scripts/export_checkpoint.py (a subprocess, as a user runs it) writes the merged weights,
    which diffusers' from_pretrained loads equal to the checkpoint's and unlike the base; generate.py
    --checkpoint_path checkpoint-N of the LoRA run (its adapter, merged) makes another video than the base model.
    (The full fine-tuning case of generate.py:
    test_generate_loads_a_checkpoint_and_its_export_alike_with_the_usual_file_modes. generate.py as a subprocess:
    tests/test_generate.py.)"""
    from diffusers import HunyuanVideo15Transformer3DModel

    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, "--max_steps", "1", "--learning_rate", "1e-2", "--use_lora"))
    ckpt = list_checkpoints(out)[-1][1]
    r = subprocess.run([sys.executable, str(ROOT / "scripts/export_checkpoint.py"), "--checkpoint", str(ckpt),
                        "--out", str(tmp_path / "exp")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    for noise in ("Guiders are currently", "Unable to import", "SiglipImageProcessor"):  # as generate.py: hidden
        assert noise not in r.stderr, r.stderr[-2000:]
    card = (tmp_path / "exp" / "README.md").read_text()  # a tiny model's run: no hub model is named its base
    assert "base_model" not in card and f"the model at `{tiny_model}`" in card
    exported = HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path / "exp").state_dict()
    trained = _weights(out)
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    # the merged LoRA differs from the base
    from sage_grpo.models.loading import load_pipeline

    base = load_pipeline(model_path=str(tiny_model), dtype="fp32", load_text_encoders=False).transformer.state_dict()
    assert any(not torch.equal(base[k], exported[k]) for k in base)

    generate = _load_script("generate", ROOT / "generate.py")
    videos = []
    for name, extra in (("base", []), ("lora", ["--checkpoint_path", str(ckpt)])):
        [path] = generate.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model_path", str(tiny_model),
                                "--prompt", "a red ball rolls", "--video_length", "5", "--num_inference_steps", "2",
                                "--output_path", str(tmp_path / f"{name}.mp4"), *extra])
        videos.append(path.read_bytes())
    assert videos[0] != videos[1]  # the trained weights were loaded


# layout -> (flags of the 2-rank run, flags shared with the one-process reference, which runs 4 videos per step)
# FSDP2 runs use AdamW: Muon's bf16 Newton-Schulz turns the ~1e-7 reduction-order differences of the gradients
# into bf16 rounding flips of the update (tests/test_parallel_fsdp.py checks ShardedMuon bitwise on equal gradients)
LAYOUTS = {
    # AdamW: Muon's bf16 Newton-Schulz turns the sp all-to-all's reduction-order differences into rounding flips of
    # the update (15-16% or 35% of how far 2 steps moved the weights, depending on the rollout noise drawn); dp2 keeps
    # Muon against one process
    "sp2": (["--sp_size", "2", "--batch_size", "4", "--enable_fsdp", "False"], ["--use_muon", "False"]),
    "dp2": (["--batch_size", "2", "--enable_fsdp", "False"], []),
    # FSDP2 with a sliding SDE window and the shared ODE prefix, the group of 4 spread over both ranks (FSDP2 without
    # a window: fsdp_sp2_lora)
    "fsdp_dp2_window": (["--batch_size", "2", "--enable_fsdp", "True"],
                        ["--use_muon", "False", "--sde_window_start", "1", "--sde_window_size", "2",
                         "--sde_window_stride", "1", "--sde_window_every", "1", "--use_same_noise", "True",
                         "--shared_prefix", "True"]),
    "fsdp_sp2_lora": (["--sp_size", "2", "--batch_size", "4", "--enable_fsdp", "True"],
                      ["--use_muon", "False", "--use_lora"]),
    # the FP8 base sharded by FSDP2, each rank quantizing its rows as it loads (sage_grpo.models.fp8)
    "fsdp_dp2_lora_fp8": (["--batch_size", "2", "--enable_fsdp", "True"],
                          ["--use_muon", "False", "--use_lora", "--fp8_base"]),
}


def _common(tiny_model) -> list[str]:
    return ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--grpo_sampling_steps", "4", "--sample_n_frames", "5",
            "--save_interval", "1", "--report_to", "none", "--model_path", str(tiny_model),
            "--train_video_csv", str(ROOT / "configs/tiny_prompts.txt")]


def _torchrun_runs(spec, runs: list[list[str]]) -> str:
    """One torchrun launch on 2 gloo ranks running `runs` (post_train.py argument lists) in turn -> its stdout."""
    spec.write_text(json.dumps(runs))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests/dist_workers/post_train_runs_worker.py"), str(spec)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model, tmp_path_factory):
    """Every 2-rank training run of this module in two torchrun launches (start-up paid twice, not once per run).
    Launch 1: each layout trains 2 steps straight (checkpoint-1 on the way, checkpoint-2 at the end), then the bf16
    master-weight run. Between the launches checkpoint-2 and the metrics of each straight run move aside to
    `<layout>/uninterrupted`; launch 2 (fresh processes) resumes each run from its checkpoint-1 to step 2 again.
    -> the root folder: `<layout>/run`, `<layout>/uninterrupted`, `bf16`."""
    import shutil

    root = tmp_path_factory.mktemp("two_rank")
    common = _common(tiny_model)
    runs = {name: [*common, *shared, *two, "--output_dir", str(root / name / "run"), "--max_steps", "2"]
            for name, (two, shared) in LAYOUTS.items()}
    bf16 = _args(tiny_model, root / "bf16", "--max_steps", "1", "--batch_size", "2", "--enable_fsdp", "True",
                 "--master_weight_type", "bf16", "--dtype", "bf16")
    _torchrun_runs(root / "launch1.json", [*runs.values(), bf16])
    for name in LAYOUTS:
        run, aside = root / name / "run", root / name / "uninterrupted"
        assert [s for s, _ in list_checkpoints(run)] == [1, 2]
        aside.mkdir()
        shutil.move(run / "checkpoint-2", aside / "checkpoint-2")
        shutil.copy(run / "metrics.jsonl", aside / "metrics.jsonl")  # 2 rows: the resume drops row 2, writes it anew
    out = _torchrun_runs(root / "launch2.json",
                         [[*argv, "--resume_from_checkpoint", "latest"] for argv in runs.values()])
    for name in LAYOUTS:
        assert f"resumed from {root / name / 'run' / 'checkpoint-1'} at step 1" in out, out[-3000:]
    return root


@pytest.fixture(scope="module")
def one_process_runs(tiny_model, tmp_path_factory):
    """The one-process reference of each layout (4 videos per step, 2 steps), run once per distinct flag set
    -> {layout: run folder}."""
    root, done = tmp_path_factory.mktemp("one_process"), {}

    def get(layout):
        shared = LAYOUTS[layout][1]
        key = " ".join(shared) or "default"
        if key not in done:
            done[key] = root / key.replace(" ", "_").replace("-", "")
            pt.main([*_common(tiny_model), *shared, "--batch_size", "4", "--max_steps", "2", "--output_dir",
                     str(done[key])])
        return done[key]

    return get


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_rank_layouts_train_resume_and_match_one_process(tiny_model, two_rank_runs, one_process_runs, layout):
    """torchrun on 2 gloo ranks, sp 2 (one data-parallel rank, Ulysses inside) or dp 2 (a group spread over both
    ranks), replicated or FSDP2-sharded: 2 steps; resumed on 2 fresh ranks from checkpoint-1, step 2 ends bitwise
    where the uninterrupted run did (weights, train state, metrics; the checkpoints load in one process, as
    generate.py --checkpoint_path does); against one process with the same 4 videos per step. (dp2 is also the old
    test_two_ranks_match_one_process: a group of 4 spread over both ranks, 2 steps against one process.)"""
    from sage_grpo.checkpoint import read_train_state

    run, aside = two_rank_runs / layout / "run", two_rank_runs / layout / "uninterrupted"
    assert [s for s, _ in list_checkpoints(run)] == [1, 2]
    assert _stable(read_metrics(run / "metrics.jsonl")) == _stable(read_metrics(aside / "metrics.jsonl"))
    sa, sb = (read_train_state(list_checkpoints(d)[-1][1]) for d in (run, aside))
    assert sa["step"] == sb["step"] == 2
    assert {k: v for k, v in sa.items() if k != "config"} == {k: v for k, v in sb.items() if k != "config"}
    resumed, straight = _weights(run), _weights(aside)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)

    one = one_process_runs(layout)
    a, b = read_metrics(run / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):  # the same rollouts (hash-seeded noise), rewards and gradients up to float rounding
        assert x["reward/total_mean"] == pytest.approx(y["reward/total_mean"], rel=1e-5)
        assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=1e-4)  # (the loss itself is ~1e-8:
        # ratio 1 makes it a sum of advantages that cancel, so it compares float noise)
        # the transformer's model FLOPs, counted per rank (an sp pair counts half of each call it makes together):
        # the two ranks' mean is half of one process's; the rollout's only without a shared prefix, which each rank
        # runs for the prompt of its part of the group
        assert x["perf/update_tflop"] == pytest.approx(y["perf/update_tflop"] / 2, rel=1e-9)
        if "--shared_prefix" not in LAYOUTS[layout][1]:
            assert x["perf/rollout_tflop"] == pytest.approx(y["perf/rollout_tflop"] / 2, rel=1e-9)
    # the update: after 2 steps the 2-rank weights are those of one process up to a fraction of how far training
    # moved them. Both optimizers are ill-conditioned here, so the strong check is the gradient norm above: Adam's
    # first steps are ~lr * sign(g), flipped by float noise where g ~ 0 (measured 0.2% with full fine-tuning, 0.005%
    # with LoRA), Muon's bf16 Newton-Schulz flips roundings (measured 15-16%).
    from sage_grpo.models.loading import load_pipeline

    shared = LAYOUTS[layout][1]
    base = load_pipeline(model_path=str(tiny_model), dtype="fp32", load_text_encoders=False).transformer.state_dict()
    w1 = _weights(one)
    moved = max(float((w1[k] - base[k]).abs().max()) for k in base)
    diff = max(float((resumed[k] - w1[k]).abs().max()) for k in base)
    assert moved > 1e-3 and diff <= (0.3 if "--use_muon" not in shared else 0.05) * moved, (moved, diff)


@pytest.mark.slow
def test_trains_against_the_tiny_videoreward(tiny_model, tmp_path):
    """Two steps with the VideoAlign reward through its real loading and scoring path (tiny random VideoReward)."""
    from sage_grpo.rewards.tiny import write_tiny_base, write_tiny_videoreward

    base = write_tiny_base(tmp_path / "Qwen2-VL-2B-Instruct")
    reward = write_tiny_videoreward(tmp_path / "VideoReward", base, layout="new")
    pt.main(_args(tiny_model, tmp_path / "run", "--reward_model", "videoalign_local", "--reward_model_path",
                  str(reward), "--reward_base_model_path", str(base),
                  "--reward_weights", '{"VQ":0.5,"MQ":0.5,"TA":1.0}',
                  "--reward_dtype", "fp32", "--reward_min_pixels", "3136"))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("reward/VQ_mean", "reward/MQ_mean", "reward/TA_mean", "reward/total_mean", "train/grad_norm"):
            assert math.isfinite(r[key]), (key, r[key])
        assert r["reward/failed"] == 0


@pytest.mark.dist
def test_fsdp_keeps_bf16_master_weights(two_rank_runs):
    """--master_weight_type bf16 under FSDP2 (2 ranks, dp 2; a run of the module's first 2-rank launch): the
    meta-built model takes the master dtype before sharding (as from_pretrained(torch_dtype=...) does unsharded),
    trains, and its checkpoint holds bf16 weights."""
    from torch.distributed.checkpoint import FileSystemReader

    out = two_rank_runs / "bf16"
    assert math.isfinite(read_metrics(out / "metrics.jsonl")[0]["train/grad_norm"])
    meta = FileSystemReader(str(list_checkpoints(out)[-1][1] / "transformer")).read_metadata()
    dtypes = {m.properties.dtype for k, m in meta.state_dict_metadata.items() if k.endswith(".weight")}
    assert dtypes == {torch.bfloat16}


@pytest.mark.slow
def test_a_run_folder_is_never_silently_overwritten(tiny_model, tmp_path, capsys):
    """Re-running a finished command refuses in one line (a subprocess, as a user runs it) before anything loads;
    --overwrite_output_dir starts over (old checkpoints gone); latest on an empty folder says it starts at 0; a
    resume already at max_steps says so and trains nothing; latest under a file can never be a run folder."""
    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, "--max_steps", "2"))
    again = subprocess.run([sys.executable, str(ROOT / "post_train.py"), *_args(tiny_model, out, "--max_steps", "2")],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = [ln for ln in again.stderr.splitlines() if ln.strip()]
    assert again.returncode == 2 and len(lines) == 1, again.stderr[-2000:]
    assert f"--output_dir {out} already holds a run (checkpoint-2, config.yaml, curves.png, metrics.jsonl)" in lines[0]
    assert "--resume_from_checkpoint latest" in lines[0] and "--overwrite_output_dir" in lines[0]
    pt.main(_args(tiny_model, out, "--max_steps", "2", "--resume_from_checkpoint", "latest"))  # already done
    assert "checkpoint-2 is already at --max_steps 2: nothing to train" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    pt.main(_args(tiny_model, out, "--max_steps", "1", "--overwrite_output_dir"))
    assert [s for s, _ in list_checkpoints(out)] == [1] and len(read_metrics(out / "metrics.jsonl")) == 1
    pt.main(_args(tiny_model, tmp_path / "fresh", "--max_steps", "1", "--resume_from_checkpoint", "latest"))
    assert f"no checkpoint in {tmp_path / 'fresh'}: starting from step 0" in capsys.readouterr().out
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(SageGRPOError, match="can never be a run folder: .*notes.txt is a file"):
        pt.main(_args(tiny_model, tmp_path / "notes.txt" / "run", "--resume_from_checkpoint", "latest"))


def test_a_resume_keeps_the_runs_settings_and_records_the_flags_that_change_them(tiny_model, tmp_path, capsys):
    """Trained with --sde_type flow_grpo, resumed with the same --config but without the sampler flag: the run goes
    on with its own sampler (the file's sage_grpo is named, not applied); the flags given override and are said;
    config.yaml holds the settings now and resumes.jsonl what each resume's flags changed."""
    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, "--max_steps", "1", "--sde_type", "flow_grpo", "--eta", "0.7"))
    capsys.readouterr()
    pt.main(_args(tiny_model, out, "--eta", "0.6", "--resume_from_checkpoint", "latest"))
    shown = capsys.readouterr().out
    assert "overridden on resume: rollout.eta: 0.7 -> 0.6; optim.max_steps: 1 -> 2" in shown, shown
    assert "rollout.sde_type: 'flow_grpo' (--config: 'sage_grpo')" in shown, shown
    saved = json.loads((out / "checkpoint-2" / "train_state.json").read_text())["config"]
    assert (saved["rollout"]["sde_type"], saved["rollout"]["eta"]) == ("flow_grpo", 0.6)
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert (written["rollout"]["sde_type"], written["rollout"]["eta"]) == ("flow_grpo", 0.6)
    records = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    same = {"world_size": 1, "sp_size": 1, "dp_replicate": 1, "dp": 1, "batch_size": 4, "videos": 4, "prompts": 1}
    assert records == [{"step": 1, "checkpoint": "checkpoint-1",
                        "overridden": {"rollout.eta": [0.7, 0.6], "optim.max_steps": [1, 2]},
                        "layout": [same, same]}]


def _keep_components(monkeypatch) -> list:
    """pt.setup wrapped to keep what it built (the real setup runs): -> the list each launch's Components go to."""
    built, real = [], pt.setup

    def setup(*a, **kw):
        c, state = real(*a, **kw)
        built.append(c)
        return c, state

    monkeypatch.setattr(pt, "setup", setup)
    return built


def test_a_resume_trains_with_the_optimizer_settings_it_says_and_records(tiny_model, tmp_path, monkeypatch, capsys):
    """Resumed with other weight decay, AdamW betas and eps: every param group of Muon and AdamW holds the values
    said, recorded in resumes.jsonl and config.yaml and saved in the next checkpoint's config (loading the optimizer
    state brought back the saved run's, and the run trained with weight decay 0.01 while it recorded 0.5)."""
    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, "--max_steps", "1"))
    built = _keep_components(monkeypatch)
    flags = {"weight_decay": 0.5, "adam_beta1": 0.5, "adam_beta2": 0.9, "adam_eps": 1e-3}
    pt.main(_args(tiny_model, out, "--resume_from_checkpoint", "latest",
                  *(x for k, v in flags.items() for x in (f"--{k}", str(v)))))
    assert "overridden on resume: optim.weight_decay: 0.01 -> 0.5; optim.adam_beta1: 0.95 -> 0.5" in \
        capsys.readouterr().out
    [record] = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    written = yaml.safe_load((out / "config.yaml").read_text())["optim"]
    saved = json.loads((out / "checkpoint-2" / "train_state.json").read_text())["config"]["optim"]
    for k, v in flags.items():
        assert record["overridden"][f"optim.{k}"][1] == written[k] == saved[k] == v, k
    [c] = built
    assert c.optimizer.names == ["muon", "adamw"]  # the tiny full fine-tuning run has both
    for g in c.optimizer["muon"].param_groups:
        assert g["weight_decay"] == written["weight_decay"]
    for g in c.optimizer["adamw"].param_groups:
        assert (g["weight_decay"], tuple(g["betas"]), g["eps"]) == (
            written["weight_decay"], (written["adam_beta1"], written["adam_beta2"]), written["adam_eps"])


@pytest.mark.slow
def test_a_resume_on_another_layout_records_both_layouts(tiny_model, tmp_path, capsys):
    """A run of 2 processes x 4 videos (its checkpoint's train state says world size 2: the one-process run's
    checkpoint rewritten so) resumed in one process trains 4 videos a step, not 8: said on one line, and recorded in
    resumes.jsonl as [the checkpoint's layout, this launch's], since no config holds the world size and no flag
    changed the batch."""
    out = tmp_path / "run"
    pt.main(_args(tiny_model, out, "--max_steps", "1"))
    state_file = out / "checkpoint-1" / "train_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "world_size": 2}))
    capsys.readouterr()
    pt.main(_args(tiny_model, out, "--resume_from_checkpoint", "latest"))
    assert "NOT the same batch: 8 -> 4 videos (2 -> 1 prompts) per step" in capsys.readouterr().out
    [record] = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    layout = {"sp_size": 1, "dp_replicate": 1, "batch_size": 4}
    assert record["layout"] == [{"world_size": 2, "dp": 2, "videos": 8, "prompts": 2, **layout},
                                {"world_size": 1, "dp": 1, "videos": 4, "prompts": 1, **layout}]


def test_resuming_the_other_kind_of_run_is_refused_before_any_model_loads(tmp_path, monkeypatch, tiny_model):
    """A full fine-tuning checkpoint resumed with --use_lora, or a LoRA one without it: one line naming the
    mismatch, before setup loads anything; the matching flag gets through to setup."""
    from sage_grpo.checkpoint import TRAIN_STATE
    from sage_grpo.config import config_to_dict, load_config

    class Loaded(Exception):
        pass

    def setup(*a, **kw):
        raise Loaded

    monkeypatch.setattr(pt, "setup", setup)
    for saved_lora in (False, True):
        out = tmp_path / f"lora_{saved_lora}"
        args = _args(str(tiny_model), out, "--max_steps", "4", "--resume_from_checkpoint", "latest")
        cfg = config_to_dict(load_config(args))
        cfg["model"]["use_lora"] = saved_lora
        (out / "checkpoint-3").mkdir(parents=True)
        (out / "checkpoint-3" / TRAIN_STATE).write_text(json.dumps({"step": 3, "config": cfg}))
        mismatch = ["--use_lora", str(not saved_lora)]
        kinds = ("a LoRA run", "a full fine-tuning run")[:: 1 if saved_lora else -1]
        with pytest.raises(SageGRPOError, match=rf"checkpoint-3 is {kinds[0]} \(use_lora {saved_lora}\) but this run "
                           rf"is {kinds[1]} \(--use_lora {not saved_lora}\): resume it with --use_lora {saved_lora}"):
            pt.main(args + mismatch)
        with pytest.raises(Loaded):
            pt.main(args + ["--use_lora", str(saved_lora)])
        with pytest.raises(Loaded):  # not given: the run's own kind
            pt.main(args)


def test_a_pending_update_that_could_never_be_taken_is_refused_before_any_model_loads(tmp_path, monkeypatch,
                                                                                     tiny_model):
    """A checkpoint written inside an accumulation (3 of 4 rounds) resumed with --gradient_accumulation_steps 2:
    the update is taken when the pending rounds reach it, which they never would; refused in one line before setup.
    With 4 (or more) it gets through."""
    from sage_grpo.checkpoint import TRAIN_STATE
    from sage_grpo.config import config_to_dict, load_config

    class Loaded(Exception):
        pass

    def setup(*a, **kw):
        raise Loaded

    monkeypatch.setattr(pt, "setup", setup)
    args = _args(str(tiny_model), tmp_path / "run", "--max_steps", "8", "--resume_from_checkpoint", "latest")
    cfg = config_to_dict(load_config(args))
    cfg["optim"]["gradient_accumulation_steps"] = 4
    (tmp_path / "run" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-3" / TRAIN_STATE).write_text(json.dumps({"step": 3, "accum_rounds": 3,
                                                                             "config": cfg}))
    with pytest.raises(SageGRPOError, match=r"checkpoint-3 holds 3 accumulated round\(s\) of an update; "
                       r"--gradient_accumulation_steps 2 would never take it: resume with "
                       r"--gradient_accumulation_steps > 3 \(the saved run's is 4\)"):
        pt.main([*args, "--gradient_accumulation_steps", "2"])
    with pytest.raises(Loaded):
        pt.main([*args, "--gradient_accumulation_steps", "4"])


def test_threads_flag_sets_torchs_threads_before_anything_loads(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    with pytest.raises(SageGRPOError, match="missing.txt"):
        pt.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--threads", "1", "--train_video_csv",
                 str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path / "run")])
    assert calls == [1]
    with pytest.raises(SageGRPOError, match="--threads must be >= 0"):
        pt.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--threads", "-1"])
