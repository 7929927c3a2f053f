"""scripts/gpu_check.py: its planner comparison, a deliberate planner error, the README block, and the --tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402

import sage_grpo.memory as plan_memory  # noqa: E402
from sage_grpo.errors import SageGRPOError  # noqa: E402


def test_compare_phases_passes_within_the_tolerance_and_fails_outside():
    planned = {"rollout": 20.0, "decode+reward": 30.0, "anchor": 21.0, "update": 40.0, "optimizer step": 25.0}
    measured = {"rollout": 19.0, "reward": 34.0, "update": 30.0, "optimizer": 25.0}  # no anchor phase ran
    rows = {r["phase"]: r for r in gpu_check.compare_phases(measured, planned, 0.10)}
    assert rows["rollout"]["verdict"] == "PASS"  # +5%
    assert rows["reward"]["verdict"] == "FAIL" and rows["reward"]["error"] == pytest.approx(30 / 34 - 1)  # -12%
    assert rows["update"]["verdict"] == "FAIL"  # +33%
    assert rows["optimizer"]["verdict"] == "PASS"
    assert rows["anchor"]["verdict"] == "not measured"
    assert all(r["verdict"] == "not measured" for r in gpu_check.compare_phases({}, planned, 0.10))


def test_a_forward_phase_without_forwards_is_not_run_not_failed():
    """The anchor phase of a first step does no forward (the anchor is the rollout's policy): its peak is what stays
    resident, 18.14 GiB against a plan of 20.62 with its forward (the H200's LoRA run), which is no planner error."""
    planned = {"rollout": 20.62, "decode+reward": 27.19, "anchor": 20.62, "update": 30.66, "optimizer step": 18.27}
    measured = {"rollout": 20.41, "reward": 27.44, "anchor": 18.14, "update": 30.42, "optimizer": 18.26}
    forwards = {"rollout": 32, "anchor": 0, "update": 32}
    rows = {r["phase"]: r["verdict"] for r in gpu_check.compare_phases(measured, planned, 0.10, forwards)}
    assert rows == {"rollout": "PASS", "reward": "PASS", "anchor": "not run", "update": "PASS", "optimizer": "PASS"}
    rows = {r["phase"]: r["verdict"] for r in gpu_check.compare_phases(measured, planned, 0.10)}
    assert rows["anchor"] == "FAIL"  # +14 % when the forwards are not looked at
    forwards["anchor"] = 16  # a step that ran the anchor's forwards is judged
    assert gpu_check.compare_phases(measured, planned, 0.10, forwards)[2]["verdict"] == "FAIL"


def test_the_first_update_ratio_passes_to_float32_rounding_only():
    assert gpu_check.ratio_verdict(1.0, 1.0) == {"exact": True, "deviation": 0.0, "verdict": "PASS"}
    full = gpu_check.ratio_verdict(0.9999998807907104, 1.0)  # the H200's full fine-tuning: 2 float32 steps below 1
    assert full["verdict"] == "PASS" and not full["exact"] and full["deviation"] == pytest.approx(1.19e-7, rel=1e-2)
    assert gpu_check.ratio_verdict(1.0, 1.00001)["verdict"] == "FAIL"  # a tenth of the clip range: a real mismatch
    assert gpu_check.ratio_verdict(0.9, 1.0)["verdict"] == "FAIL"
    assert gpu_check.ratio_verdict(float("nan"), 1.0)["verdict"] == "FAIL"
    assert gpu_check.ratio_verdict(1.0, float("nan"))["verdict"] == "FAIL"  # max(0.0, nan) is 0.0: not a PASS
    assert gpu_check.ratio_verdict(None, None)["verdict"] == "FAIL"  # no ratio logged (no trained pair)


def test_a_tiny_part_is_judged_with_the_allocators_rounding():
    """The H200's build stage: the tiny text encoder's 36,352 bf16 parameters (72,704 bytes) occupied 81,408 bytes
    (each tensor rounded up to 512 bytes, plus buffers); within that rounding it passes, without it it failed."""
    import torch  # noqa: F401

    from sage_grpo.models.tiny import build_tiny_components

    enc = build_tiny_components(0)["text_encoder"]
    tensors = len(list(enc.parameters())) + len(list(enc.buffers()))
    assert sum(p.numel() for p in enc.parameters()) == 36_352
    gib = 2**30
    assert gpu_check.part_verdict(72_704 / gib, 81_408 / gib, tensors, 0.10) == "PASS"
    assert gpu_check.part_verdict(72_704 / gib, 81_408 / gib, 0, 0.10) == "FAIL"
    assert gpu_check.part_verdict(15.470046, 15.470100, 1_000, 0.10) == "PASS"  # the 8.3B transformer
    assert gpu_check.part_verdict(15.47, 18.0, 1_000, 0.10) == "FAIL"


@pytest.mark.slow  # the 54-block LoRA model on the meta device: peft wraps ~650 layers
def test_a_planner_error_fails_the_comparison(tmp_path, monkeypatch):
    """A GPU that measured exactly what the planner predicts for the lora stage's run (54 blocks, 81x352x624, LoRA on
    bf16, 141 GiB) passes; the same measurement against a planner whose activation estimate is halved fails in the
    update phase (seen failing: update -20.2%, while rollout and anchor moved -5.9% and passed)."""
    ck = gpu_check.Check(gpu_check.parse(["--out", str(tmp_path), "--gpu_memory_gib", "141"]))
    argv = ck.post_train_argv(tmp_path / "model", "lora", gpu_check.LORA_FLAGS)
    tcfg = gpu_check.transformer_config(False, 54)
    counts = plan_memory.count_transformer(plan_memory.build_transformer(tcfg), use_lora=True)
    parts = {**plan_memory.count_frozen_parts(), "reward": 0}
    right = gpu_check.planned_phases(argv, tcfg, parts, 141.0, counts=counts)["phases_gib"]
    measured = {ph: right[plan_ph] for ph, plan_ph in gpu_check.PHASE_MAP.items()}
    assert all(r["verdict"] == "PASS" for r in gpu_check.compare_phases(measured, right, 0.10))

    original = plan_memory.block_activation_bytes
    monkeypatch.setattr(plan_memory, "block_activation_bytes", lambda **kw: original(**kw) // 2)
    wrong = gpu_check.planned_phases(argv, tcfg, parts, 141.0, counts=counts)["phases_gib"]
    rows = {r["phase"]: r for r in gpu_check.compare_phases(measured, wrong, 0.10)}
    print({k: f"{r['error']:+.1%} {r['verdict']}" for k, r in rows.items()})
    assert rows["update"]["verdict"] == "FAIL", rows["update"]
    assert rows["update"]["error"] < -0.10


# peak GiB per phase measured on one H200 (torch 2.11.0+cu130, diffusers 0.42.1, random weights), step 1 of
# `python scripts/gpu_check.py --stage lora,full --steps 1`: 480p_t2v, 81x352x624, 2 videos, T 8, CFG 6 (the anchor
# phase of a first step runs no forward and is left out)
H200_PEAKS = {("lora", 54): {"rollout": 20.41, "reward": 27.44, "update": 30.42, "optimizer": 18.26},
              ("full", 45): {"rollout": 95.21, "reward": 89.47, "update": 127.11, "optimizer": 106.15}}


@pytest.mark.slow  # the 54-block LoRA model on the meta device
def test_the_plan_is_within_ten_percent_of_the_h200_peaks(tmp_path, monkeypatch):
    """The planner against the one real-size GPU measurement: every phase within the check's 10 %. With the factor 2
    the planner used before for the checkpointed backward's working set, the LoRA update is planned 11.4 % high."""
    ck = gpu_check.Check(gpu_check.parse(["--out", str(tmp_path), "--gpu_memory_gib", "139.8"]))
    parts = {**plan_memory.count_frozen_parts(), "reward": 0}  # the text encoders are offloaded by then

    def errors(kind: str, blocks: int, counts: dict) -> dict:
        flags = gpu_check.LORA_FLAGS if kind == "lora" else gpu_check.FULL_FLAGS
        argv = ck.post_train_argv(tmp_path / "model", kind, flags)
        tcfg = gpu_check.transformer_config(False, blocks)
        planned = gpu_check.planned_phases(argv, tcfg, parts, 139.8, counts=counts)["phases_gib"]
        return {r["phase"]: r["error"] for r in gpu_check.compare_phases(H200_PEAKS[kind, blocks], planned, 0.10)
                if r["error"] is not None}

    counts = {(kind, b): plan_memory.count_transformer(plan_memory.build_transformer(
        gpu_check.transformer_config(False, b)), use_lora=kind == "lora") for kind, b in H200_PEAKS}
    for (kind, blocks), peaks in H200_PEAKS.items():
        err = errors(kind, blocks, counts[kind, blocks])
        print(kind, {k: f"{v:+.1%}" for k, v in err.items()})
        assert set(err) == set(peaks) and all(abs(e) <= 0.10 for e in err.values()), (kind, err)
    monkeypatch.setattr(plan_memory, "BACKWARD_BLOCKS", 2.0)
    assert errors("lora", 54, counts["lora", 54])["update"] == pytest.approx(0.114, abs=0.002)


def test_update_readme_fills_the_marked_block_only(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{gpu_check.README_BEGIN}\nold table\n{gpu_check.README_END}\nafter\n")
    gpu_check.update_readme("| new | table |", readme)
    assert readme.read_text() == (f"# x\nbefore\n{gpu_check.README_BEGIN}\n| new | table |\n{gpu_check.README_END}"
                                  "\nafter\n")
    readme.write_text("no block\n")
    with pytest.raises(SageGRPOError, match="gpu_check:begin"):
        gpu_check.update_readme("x", readme)
    # the project's README has the block the script fills
    text = (ROOT / "README.md").read_text()
    assert gpu_check.README_BEGIN in text and gpu_check.README_END in text


@pytest.mark.slow  # 25 s wall alone on the 2-core machine, one GRPO step per run (mostly the inductor build)
def test_tiny_gpu_check_runs_every_stage(tmp_path):
    out = tmp_path / "out"
    # one GRPO step per measured run: the counts, the plan and the first update's ratio need no second step
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--tiny", "--steps", "1", "--out",
                           str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in gpu_check.STAGES:
        report = json.loads((out / f"gpu_check_{stage}.json").read_text())
        assert report["benchmark"] == f"gpu_check_{stage}" and report["results"]["tiny"] is True
    for stage in ("lora", "full"):
        res = json.loads((out / f"gpu_check_{stage}.json").read_text())["results"]
        assert res["first_update_ratio"]["verdict"] == "PASS"  # re-scoring reproduced the rollout's log-probs
        assert [r["verdict"] for r in res["plan_comparison"]] == ["not measured"] * len(gpu_check.PHASE_MAP)
        assert all(v is not None for v in res["plan_phases_gib"].values())
        assert res["forwards_per_step"] == res["minimum_forwards_per_step"]
    compiled = json.loads((out / "gpu_check_compile.json").read_text())["results"]
    assert set(compiled["seconds_per_phase"]) == {"eager", "compiled"}
    recipes = json.loads((out / "gpu_check_recipes.json").read_text())["results"]["recipes"]
    assert all(r["at_minimum"] and r["first_update_ratio"] == "PASS" for r in recipes.values())
    assert recipes["cfg_free"]["forwards_over_paper"] == pytest.approx(0.5)  # one forward instead of a CFG pair
    md = (out / "gpu_check.md").read_text()
    assert "**lora**" in md and "**full**" in md and "**compile**" in md and "| cfg_free_sliding |" in md
    summary = gpu_check.render_summary(out)  # README's block: a row per run, every stage present
    assert "| LoRA, 480p_t2v 9x32x32, 2 blocks |" in summary
    assert "| full fine-tuning, 480p_t2v 9x32x32, 2 blocks |" in summary
    assert "cfg_free_sliding " in summary and "LoRA exactly 1 (PASS), full exactly 1 (PASS)" in summary
    assert "b2 PASS" in summary and "(--tiny: CPU, tiny model)" in summary


def test_each_version_is_measured_at_its_own_size_task_and_sampling_defaults(tmp_path):
    """--version: 480p_t2v keeps the paper's 81x352x624; the others train at the 16:9 bucket of
    hv15_variants.md's table (480p 480x848, 720p 720x1280), with the version's flow shift and CFG scale; an I2V
    version trains on a prompt file of reference images of that size, and the planner plans the I2V run at 720p
    with its 75,600 video tokens (81 frames), the 729 SigLIP tokens and the image encoder."""
    from sage_grpo.data import read_prompts
    from sage_grpo.models.image_cond import open_reference_image

    sizes = {"480p_t2v": (352, 624), "480p_i2v": (480, 848), "720p_t2v": (720, 1280), "720p_i2v": (720, 1280),
             "480p_i2v_step_distilled": (480, 848)}
    argvs = {}
    for version, (h, w) in sizes.items():
        ck = gpu_check.Check(gpu_check.parse(["--version", version, "--out", str(tmp_path / "out"), "--ckpt_dir",
                                              str(tmp_path / "ck")]))
        assert (ck.frames, ck.height, ck.width) == (81, h, w), version
        argv = argvs[version] = ck.post_train_argv(tmp_path / "model", version, gpu_check.FULL_FLAGS)
        shift, cfg = (argv[argv.index(f) + 1] for f in ("--flow_shift", "--cfg_scale"))
        assert (shift, cfg) == {"480p_t2v": ("5", "6"), "480p_i2v": ("5", "6"), "720p_t2v": ("9", "6"),
                                "720p_i2v": ("7", "6"), "480p_i2v_step_distilled": ("7", "1")}[version]
        records = read_prompts(argv[argv.index("--train_video_csv") + 1])
        assert all(bool(r.ref_image_path) == ("i2v" in version) for r in records)
        if "i2v" in version:
            assert open_reference_image(records[0].ref_image_path).size == (w, h)
    tcfg = gpu_check.transformer_config(False, 54, "720p_i2v")
    assert tcfg["task_type"] == "i2v" and tcfg["image_embed_dim"] == 1152 and tcfg["target_size"] == 960
    parts = {**plan_memory.count_frozen_parts(), "reward": 0}
    pl = gpu_check.planned_phases(argvs["720p_i2v"], tcfg, parts, 80.0)
    assert pl["setting"]["video_tokens"] == 75_600 and pl["setting"]["video"] == "81x720x1280"
    assert pl["terms_gib"]["image encoder before offload"] > 0
    t2v = gpu_check.planned_phases(argvs["720p_t2v"], gpu_check.transformer_config(False, 54, "720p_t2v"), parts,
                                   80.0)
    assert pl["setting"]["text_tokens"] == t2v["setting"]["text_tokens"] + 729


def test_unknown_version_is_one_line(tmp_path):
    with pytest.raises(SageGRPOError, match="unknown HunyuanVideo-1.5 version '540p_t2v'; valid: 480p_t2v"):
        gpu_check.Check(gpu_check.parse(["--version", "540p_t2v", "--out", str(tmp_path)]))


@pytest.mark.slow  # 9 s wall on an idle 2-core machine
def test_tiny_gpu_check_of_a_720p_i2v_version(tmp_path, capsys, monkeypatch):
    """The same stages with --version 720p_i2v on the tiny model: an I2V random checkpoint (SigLIP included) at the
    720p bucket base, trained on reference images by post_train (ratio 1 at the first update) and planned as I2V.
    (In this process, through the script's main; the script as a process: test_tiny_gpu_check_runs_every_stage.)"""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # main sets it for --tiny; restored after the test
    out = tmp_path / "out"
    code = gpu_check.main(["--tiny", "--version", "720p_i2v", "--stage", "build,lora", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-3000:]
    assert "image-to-video: 8 reference images, training videos 48x48" in stdout
    build = json.loads((out / "gpu_check_build.json").read_text())["results"]
    assert build["version"] == "720p_i2v" and build["config"]["task_type"] == "i2v"
    assert [r["part"] for r in build["parts"]][-1] == "image_encoder" and build["planner_counts_transformer_exactly"]
    lora = json.loads((out / "gpu_check_lora.json").read_text())["results"]
    assert lora["version"] == "720p_i2v" and lora["geometry"] == [9, 48, 48] and lora["task"] == "i2v"
    assert lora["first_update_ratio"]["verdict"] == "PASS"
    assert all(v is not None for v in lora["plan_phases_gib"].values())
    assert "**lora** (720p_i2v 9x48x48" in (out / "gpu_check.md").read_text()


def _run_report(out: Path, stage: str, tflops: dict, peak, matmul) -> None:
    """A lora/full report as measured_run writes it, with only what the tables read."""
    from sage_grpo.benchjson import write_report

    phases = list(gpu_check.PHASE_MAP)
    rows = [{"phase": ph, "plan_phase": gpu_check.PHASE_MAP[ph], "measured_gib": 20.0, "planned_gib": 20.5,
             "error": 0.025, "verdict": "PASS"} for ph in phases]
    res = {"tiny": False, "version": "480p_t2v", "geometry": [81, 352, 624], "blocks": 54, "videos_per_step": 2,
           "seconds_per_phase": {ph: 10.0 for ph in phases}, "seconds_per_phase_per_video": {ph: 5.0 for ph in phases},
           "forwards_per_step": [{"rollout": 32, "anchor": 0, "update": 32}], "plan_comparison": rows,
           "first_update_ratio": {"min": 1.0, "max": 1.0, "exact": True, "verdict": "PASS"},
           "peak_tflops": peak, "matmul_tflops": matmul,
           "utilisation": gpu_check.utilisation(tflops, peak, matmul)}
    write_report(out / f"gpu_check_{stage}.json", f"gpu_check_{stage}", "cpu", {}, res, [])


def test_tables_show_tflops_and_mfu_against_the_datasheet_and_the_measured_matmul(tmp_path):
    _run_report(tmp_path, "lora", {"rollout": 300.0, "anchor": float("nan"), "update": 250.0, "step": 200.0},
                peak=1000.0, matmul=750.0)
    report = tmp_path / "gpu_check_lora.json"
    data = json.loads(report.read_text())
    data["results"]["plan_comparison"][2]["verdict"] = "not run"  # the anchor of a first step: no forward
    report.write_text(json.dumps(data))
    summary = gpu_check.render_summary(tmp_path)
    assert ("| run | phase | s per video | TFLOP/s | MFU of the bf16 peak (of the measured matmul rate) | peak GiB |"
            in summary)
    row = next(line for line in summary.splitlines() if line.startswith("| LoRA, "))
    # rollout / decode+reward / anchor (no forward) / update / optimizer step
    assert "| 300 / - / - / 250 / - |" in row
    assert "| 30% (40%) / - / - / 25% (33%) / - |" in row
    # the full fine-tuning run is not measured: every cell says so
    assert "| full fine-tuning | " + " / ".join(gpu_check.PHASE_MAP.values()) + " | " + " | ".join(
        [gpu_check.NOT_MEASURED] * 6) + " |" in summary
    assert all(line.count("|") == 9 for line in summary.splitlines() if line.startswith("|"))  # 8 columns each
    md = gpu_check.render_markdown(tmp_path)
    assert "bf16 matmul rate of this card: 750 TFLOP/s measured, 1000 on the datasheet" in md
    assert "| update | 10.00 | 5.00 | 32 | 250 | 25% (33%) | 20.00 |" in md


def test_an_unknown_card_has_tflops_without_mfu(tmp_path):
    _run_report(tmp_path, "lora", {"rollout": 300.0, "anchor": None, "update": 250.0, "step": 200.0},
                peak=None, matmul=None)
    row = next(line for line in gpu_check.render_summary(tmp_path).splitlines() if line.startswith("| LoRA, "))
    assert "| 300 / - / not yet measured on a GPU / 250 / - |" in row
    assert "not yet measured on a GPU / - / not yet measured on a GPU / not yet measured on a GPU / -" in row
    assert gpu_check.matmul_tflops("cpu") is None
