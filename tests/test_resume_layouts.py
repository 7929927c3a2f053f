"""A checkpoint continued on another layout (world size, --sp_size, --dp_replicate) with the same videos per step
ends where the uninterrupted run does, up to the reduction order of the new layout (docs/scaling.md, "Continuing on
another number of GPUs"). One torchrun launch (2 gloo ranks) between one-process runs covers seven cases, each checked
against the uninterrupted run of the layout it was saved on:

- full: full fine-tuning, AdamW, FSDP2 on 2 ranks (dp 2, 2 videos each), 4 steps; the moving anchor is refreshed at
  step 3 (after update 2), so checkpoint-3 holds a sharded anchor that step 4 measures KL against; continued in one
  process (4 videos) for step 4.
- lora: LoRA, Muon, sp 2 under FSDP2 on 2 ranks (one data-parallel rank, 4 videos), 4 steps; checkpoint-3 (a
  refreshed LoRA anchor) continued in one process (sp 1) for step 4.
- hsdp: full fine-tuning, AdamW, HSDP on 2 ranks (--dp_replicate 2: two replicas of one shard each), 4 steps;
  checkpoint-3 continued in one process (dp_replicate 1) for step 4.
- updates: full fine-tuning, AdamW, FSDP2 on 2 ranks, 2 optimizer updates per rollout round (chunks of one
  video): each update trains the same global videos on 2 ranks of 2 as in one process of 4 (0 and 2, then 1 and 3),
  so checkpoint-3 continued in one process ends where the 2-rank run does.
- pending: full fine-tuning, AdamW, one process, 2 rounds per update; a stop signal in round 3 writes checkpoint-3
  with the round's gradient, L_KL sum and pair count pending (the anchor is not the policy then, so the L_KL sum is
  not 0); continued on 2 FSDP2 ranks (dp 2; rank 1 is new) for round 4, where the update is taken and the KL
  controller records it.
- pending_2to1: the same stop in round 3 of a run on 2 FSDP2 ranks (both ranks signalled, as torchrun forwards a
  stop), continued in one process for round 4: the two ranks' pending L_KL sums and their resharded gradients meet on
  one rank.
- pending_replicated: the same on 2 ranks without FSDP2 (each rank holds the whole model and its own pending
  gradient; the checkpoint holds their synced mean).

Tolerance. The continued step computes the same sums in another order (FSDP2's reduce-scatter, the gradient sum over the
sp group, another micro-batch split): float32 roundings of ~1e-7 relative. Measured, the weights after the continued
step differ from the uninterrupted run's by at most 1.2e-7 (AdamW cases: full and hsdp 1.5e-8, pending 6.3e-8,
pending_2to1 1.2e-7, pending_replicated 4.1e-8), where that step moved them 3.0e-3 (Adam's early steps are ~lr = 3e-3
per weight); the bound is 2e-6, 17x the largest and still 1500x below one step. Muon (lora) runs its Newton-Schulz in
bf16, so those ~1e-7 input differences flip a few bf16 roundings: measured 7.9e-6 of a 3.7e-3 step, bound 1e-4 (13x).
Metrics (reward, KL, KL coefficient) and the KL controller's history: relative 1e-5; the gradient norm 1e-4. Breaking
the continuation fails them: the optimizer state not loaded (full, lora), the refreshed anchor not loaded (full), the
pending gradients not loaded or rank 0's pending L_KL taken on every rank (pending), the layout line dropped (lora), the
first rank's pending L_KL taken for the total (pending_2to1: the KL history's last entry 0.0 against 0.073), each rank's
own gradient saved instead of their synced mean (pending_replicated: gradient norm 0.0251 against 0.0175), each
rank's own chunks split in halves for the updates (updates: the 2 ranks train videos 0 and 2 in the first update,
one process 0 and 1; the weights 4.4e-3 apart, 2.4e-7 with the split by global index).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import sigterm_in_step
from post_train_helpers import ROOT, _stable, _weights, pt

from sage_grpo.checkpoint import list_checkpoints, read_train_state
from sage_grpo.metrics import read_metrics

pytestmark = pytest.mark.dist


def _common(tiny_model, out, *extra) -> list[str]:
    return ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--grpo_sampling_steps", "4", "--sample_n_frames", "5",
            "--report_to", "none", "--model_path", str(tiny_model), "--train_video_csv",
            str(ROOT / "configs/tiny_prompts.txt"), "--max_steps", "4", "--update_ref_model_step", "2",
            "--output_dir", str(out), *extra]


# case -> (flags of every run of the case, flags of its 2-rank runs, flags of its one-process runs)
ADAMW = ["--use_muon", "False", "--save_interval", "3"]
PENDING = ["--use_muon", "False", "--gradient_accumulation_steps", "2", "--save_interval", "0"]
FSDP2 = ["--enable_fsdp", "True", "--batch_size", "2"]
CASES = {
    "full": (ADAMW, FSDP2, ["--batch_size", "4"]),
    "lora": (["--use_lora", "--save_interval", "3"], ["--enable_fsdp", "True", "--sp_size", "2", "--batch_size", "4"],
             ["--batch_size", "4"]),
    "hsdp": (ADAMW, [*FSDP2, "--dp_replicate", "2"], ["--batch_size", "4"]),
    "updates": ([*ADAMW, "--updates_per_rollout", "2", "--mini_batch_size_per_update", "1"], FSDP2,
                ["--batch_size", "4"]),
    "pending": (PENDING, FSDP2, ["--batch_size", "4"]),
    "pending_2to1": (PENDING, FSDP2, ["--batch_size", "4"]),
    "pending_replicated": (PENDING, ["--batch_size", "2"], ["--batch_size", "4"]),
}
STEP = 3  # the checkpoint each continuation starts from
# what the continuation's layout line says changed
CHANGED = {
    "full": "world size 2 -> 1, batch_size per rank 2 -> 4 (data-parallel ranks 2 -> 1)",
    "lora": "world size 2 -> 1, sp_size 2 -> 1 (data-parallel ranks 1 -> 1)",
    "hsdp": "world size 2 -> 1, dp_replicate 2 -> 1, batch_size per rank 2 -> 4 (data-parallel ranks 2 -> 1)",
    "updates": "world size 2 -> 1, batch_size per rank 2 -> 4 (data-parallel ranks 2 -> 1)",
    "pending": "world size 1 -> 2, batch_size per rank 4 -> 2 (data-parallel ranks 1 -> 2)",
    "pending_2to1": "world size 2 -> 1, batch_size per rank 2 -> 4 (data-parallel ranks 2 -> 1)",
    "pending_replicated": "world size 2 -> 1, batch_size per rank 2 -> 4 (data-parallel ranks 2 -> 1)",
}
STOPPED = ("pending_2to1", "pending_replicated")  # stopped inside an accumulation on 2 ranks, continued in one process
SAVED = ("full", "lora", "hsdp", "updates")  # checkpoint-3 of the uninterrupted 2-rank run, continued in one process


def _torchrun(spec, runs: list[list[str]]) -> str:
    spec.write_text(json.dumps(runs))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests/dist_workers/post_train_runs_worker.py"), str(spec)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _continue_from(src, step: int, dst) -> None:
    """A run folder `dst` holding only checkpoint-`step` of `src` (the continuation starts there)."""
    dst.mkdir(parents=True)
    shutil.copytree(src / f"checkpoint-{step}", dst / f"checkpoint-{step}")


def _check_pending(path) -> None:
    """checkpoint-3 of a run stopped in round 3 holds that round pending."""
    state = read_train_state(path)
    assert state["step"] == STEP and state["accum_rounds"] == 1 and (path / "gradients" / ".metadata").is_file()
    assert sum(r[0] for r in state["pending_kl_by_dp_rank"]) > 0  # the anchor is not the policy in round 3


@pytest.fixture(scope="module")
def layout_runs(tiny_model, tmp_path_factory):
    """-> (root, {case: the continuation's log}): `<case>/straight` the uninterrupted run, `<case>/run` the one
    continued on the other layout. Every 2-rank run is in one torchrun launch."""
    root = tmp_path_factory.mktemp("layouts")
    every, _, one = CASES["pending"]
    pt.main(_common(tiny_model, root / "pending" / "straight", *every, *one))
    with pytest.MonkeyPatch.context() as mp:  # a stop signal in round 3 (state.step 2), inside the second update
        mp.setattr(pt, "backward_phase", sigterm_in_step(pt.backward_phase, 2))
        stopped = _run_captured(_common(tiny_model, root / "pending" / "run", *every, *one))
    assert "stopped by SIGTERM after step 3" in stopped
    [(step, path)] = list_checkpoints(root / "pending" / "run")
    _check_pending(path)

    runs: list = [_common(tiny_model, root / c / "straight", *CASES[c][0], *CASES[c][1])
                  for c in (*SAVED, *STOPPED)]
    for case in STOPPED:
        every, two, _ = CASES[case]
        runs.append({"argv": _common(tiny_model, root / case / "run", *every, *two), "sigterm_in_step": 2})
    every, two, _ = CASES["pending"]
    runs.append(_common(tiny_model, root / "pending" / "run", *every, *two, "--resume_from_checkpoint", "latest"))
    launch = _torchrun(root / "launch.json", runs)
    assert launch.count(f"stopped by SIGTERM after step {STEP}") == 2  # rank 0's line of each 2-rank stop
    for case in STOPPED:
        [(step, path)] = list_checkpoints(root / case / "run")
        _check_pending(path)
        assert len(read_train_state(path)["pending_kl_by_dp_rank"]) == 2
    logs = {"pending": launch}
    for case in (*SAVED, *STOPPED):
        every, _, one = CASES[case]
        if case not in STOPPED:
            _continue_from(root / case / "straight", STEP, root / case / "run")
            refreshed = read_train_state(root / case / "run" / f"checkpoint-{STEP}")["anchor_refreshed_at"]
            assert refreshed, case  # the continuation starts from a refreshed anchor
        logs[case] = _run_captured(_common(tiny_model, root / case / "run", *every, *one, "--resume_from_checkpoint",
                                           "latest"))
    return root, logs


def _run_captured(argv) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        pt.main(argv)
    sys.stdout.write(buf.getvalue())
    return buf.getvalue()


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_continued_on_another_layout_ends_where_the_uninterrupted_run_does(layout_runs, case):
    root, logs = layout_runs
    run, straight = root / case / "run", root / case / "straight"
    log = logs[case]
    assert (f"checkpoint-{STEP} was written on another layout: {CHANGED[case]}; the same 4 videos (1 prompts) per "
            "step") in log, log[-2000:]
    if case == "pending":
        assert "rank 1 new: RNG seeded from (seed, step, rank)" in log
    else:
        assert "rng_rank1 not read" in log
    assert "not exact" not in log  # no setting differs: the batch per rank is compared as videos per step

    sa, sb = (read_train_state(list_checkpoints(d)[-1][1]) for d in (run, straight))
    last = sb["step"]
    assert sa["step"] == last == 4
    for key in ("updates", "accum_rounds", "sampler", "anchor_refreshed_at", "anchor_synced", "skipped_updates"):
        assert sa[key] == sb[key], key
    ca, cb = sa["controller"], sb["controller"]
    assert ca["num_updates"] == cb["num_updates"] and len(ca["kl_history"]) == len(cb["kl_history"])
    assert ca["value"] == pytest.approx(cb["value"], rel=1e-5)
    assert ca["kl_history"] == pytest.approx(cb["kl_history"], rel=1e-5)
    assert any(x > 0 for x in cb["kl_history"])  # the KL terms were live

    rows_a, rows_b = read_metrics(run / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    a, b = rows_a[-1], rows_b[-1]
    assert a["step"] == b["step"] == last and set(_stable([a])[0]) == set(_stable([b])[0])
    for k in ("reward/total_mean", "kl/pos", "kl/coef", "train/lr"):
        if k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-12), k
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)

    wa, wb = _weights(run), _weights(straight)
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wb)
    print(f"{case}: max weight difference {diff:.3g}")
    assert diff <= (1e-4 if case == "lora" else 2e-6), diff
