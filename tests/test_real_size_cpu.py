"""scripts/real_size_cpu.py end to end on miniature configs: the same stages, entry points and checks as the
8.3B run (the real one is a benchmark of about an hour, in docs/performance.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_miniature_run_trains_resumes_bitwise_exports_and_generates(tmp_path):
    work = tmp_path / "rs"
    p = subprocess.run([sys.executable, str(ROOT / "scripts/real_size_cpu.py"), "--miniature", "--work", str(work),
                        "--threads", "1", "--stages", "train,resume,export,fsdp,planner"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "needs 1 GiB free disk" in p.stdout  # the resource line comes first
    res = json.loads((work / "real_size_cpu.json").read_text())
    phases = {ph["phase"]: ph for ph in res["train"]["phases"]}
    for name in ("load conditioning", "text encoding", "load policy", "rollout", "reward", "update", "save"):
        assert phases[name]["peak_rss_gib"] > 0.1 and phases[name]["seconds"] >= 0
    assert len(res["train"]["step_s"]) == 2
    assert all(step["update"] > 0 and step["step"] > 0 for step in res["train"]["step_tflops"])
    # step 2 of the resumed run equals step 2 of the uninterrupted one, and step 2 did change the adapter
    assert res["resume"]["bitwise"] and res["resume"]["step2_change"] > 0
    assert "load checkpoint" in {ph["phase"] for ph in res["resume"]["phases"]}
    assert "adapter_model.safetensors" in res["export"]["peft_files"] and res["export"]["comfy_files"]
    assert res["export"]["videos"] and (work / "export" / res["export"]["videos"][0]).stat().st_size > 0
    assert res["planner"]["terms_gib"]["policy weights"] > 0
    # two FSDP2 ranks: the LoRA step equals the one-process step, and neither rank holds what the other does not
    # (an extra gathered block, or state kept on rank 0 alone, shows as live tensor bytes on one rank only)
    fsdp = res["fsdp"]
    assert fsdp["max_abs_diff_vs_one_process"] <= 1e-6 * fsdp["adapter_max_abs"], fsdp
    sym = fsdp["rank_asymmetry"]
    assert {"load policy", "rollout", "reward", "update"} <= set(sym), sym
    for phase, row in sym.items():
        assert min(row["tensors_gib"]) > 0 and row["tensors_excess"] <= 0.05, (phase, row)
    assert "What is alive at each phase's end on each FSDP2 rank" in p.stdout
    assert not (work / "checkpoint").exists()  # deleted without --keep
    assert "| train | update |" in p.stdout  # the table


def test_a_work_folder_of_other_settings_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """The stages reuse --work's checkpoint and compare with its runs; a folder written with other settings (here 8
    blocks, now 54) is refused in one line that names the difference, before any stage."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import load_script

    rs = load_script("real_size_cpu")
    work = tmp_path / "rs"
    work.mkdir()
    settings = {k: getattr(rs.parse(["--work", str(work)]), k) for k in rs.SETTINGS}
    (work / "real_size_cpu.json").write_text(json.dumps({"settings": {**settings, "blocks": 8}}))
    with pytest.raises(SystemExit, match=r"other settings \(blocks 8 where this run has 54\): pass another --work"):
        rs.main(["--work", str(work), "--stages", "fsdp"])
    assert sorted(p.name for p in work.iterdir()) == ["real_size_cpu.json"]  # nothing written
    (work / "real_size_cpu.json").write_text(json.dumps({"settings": settings}))  # the same settings: accepted

    def stop(a, stages):  # the next step after the check: stop there (the real one would write the 8.3B checkpoint)
        raise SystemExit("reached the resource check")

    monkeypatch.setattr(rs, "check_resources", stop)
    with pytest.raises(SystemExit, match="reached the resource check"):
        rs.main(["--work", str(work), "--stages", "fsdp"])


def test_the_table_shows_the_training_runs_tflops():
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import load_script

    rs = load_script("real_size_cpu")
    train = {"phases": [], "step_tflops": [{"rollout": 0.0123, "anchor": None, "update": 0.0456, "step": 0.02}],
             "step_mfu": [{"rollout": 0.25, "anchor": None, "update": None, "step": None}]}
    text = rs.table({"train": train})
    assert "| step | rollout | anchor | update | step |" in text
    assert "| 1 | 0.0123 (25.0% MFU) | - | 0.0456 | 0.02 |" in text
