"""sage_grpo.metrics: curves.png a person can read, the sinks' media and config, the missing-sink errors."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.metrics import (
    STRIP_FRAMES,
    STRIP_HEIGHT,
    MetricsLogger,
    check_report_to,
    curves_figure,
    frame_strip,
    plot_curves,
    read_metrics,
)


def _rows():
    """Ten steps of a run whose anchor is refreshed every 3 updates: at steps 1, 4, 7, 10 the anchor equals the
    policy and KL_pos / KL_vel are exactly 0, between them they grow over decades."""
    rows = []
    for step in range(1, 11):
        synced = (step - 1) % 3 == 0
        kl = 0.0 if synced else 10.0 ** (-8 + 2 * ((step - 1) % 3))
        rows.append({"step": step, "kl/anchor_synced": int(synced), "kl/pos": kl, "kl/vel": kl / 2, "kl/loss": kl,
                     "kl/coef": 0.01 * 1.1**step, "reward/total_mean": 0.3 + 0.02 * step,
                     "reward/total_std": 0.05 + 0.01 * step, "train/clipfrac": 0.1 * (step % 2),
                     "train/grad_norm": None if step == 5 else 1.0 + step, "train/lr": 1e-5})
    rows[5]["val/reward_total"] = 0.5
    return rows


def _line(ax, label):
    found = [ln for ln in ax.lines if ln.get_label() == label]
    assert len(found) == 1, [ln.get_label() for ln in ax.lines]
    return list(found[0].get_xdata()), list(found[0].get_ydata())


def test_curves_leave_out_the_exact_zeros_after_a_refresh_and_band_the_reward(tmp_path):
    import matplotlib.pyplot as plt

    rows = _rows()
    fig = curves_figure(rows)
    try:
        ax_r, ax_k, ax_c, ax_f, ax_g, ax_l, ax_h = fig.axes
        synced = [r["step"] for r in rows if r["kl/anchor_synced"]]
        assert synced == [1, 4, 7, 10]
        for label, key in (("KL_pos", "kl/pos"), ("KL_vel", "kl/vel"), ("L_KL", "kl/loss")):
            x, y = _line(ax_k, label)
            assert x == [r["step"] for r in rows]
            drawn = {s: v for s, v in zip(x, y) if math.isfinite(v)}
            assert drawn == {r["step"]: r[key] for r in rows if not r["kl/anchor_synced"]}  # no refresh step drawn
        assert ax_k.get_yscale() == "log"
        y = [v for v in _line(ax_k, "KL_pos")[1] if math.isfinite(v)]
        assert max(y) / min(y) == pytest.approx(1e2)  # the curve spans its 2 decades, not 28
        marks = [ln for ln in ax_k.lines if ln.get_linestyle() == ":"]
        assert sorted(ln.get_xdata()[0] for ln in marks) == synced  # refresh steps marked instead

        # the band is mean - std .. mean + std at every step
        (band,) = ax_r.collections
        verts = band.get_paths()[0].vertices
        for r in rows:
            m, s = r["reward/total_mean"], r["reward/total_std"]
            ys = sorted(v[1] for v in verts if v[0] == r["step"])
            assert ys[0] == pytest.approx(m - s) and ys[-1] == pytest.approx(m + s)
        assert _line(ax_r, "rollout reward (mean)")[1] == [r["reward/total_mean"] for r in rows]
        assert _line(ax_r, "validation reward (ODE)") == ([6], [0.5])

        assert ax_c.lines[0].get_ydata().tolist() == [r["kl/coef"] for r in rows]
        assert ax_f.lines[0].get_ydata().tolist() == [r["train/clipfrac"] for r in rows]
        assert ax_g.lines[0].get_xdata().tolist() == [s for s in range(1, 11) if s != 5]  # a skipped update: null
        assert ax_l.lines[0].get_ydata().tolist() == [1e-5] * 10
    finally:
        plt.close(fig)

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_curves(path, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_curves_put_the_held_out_metrics_beside_the_trained_reward():
    """The bottom panel: val_shift/* against step, the trained reward in bold, the validation that raised a hacking
    warning marked once; a run without validation says so instead."""
    import matplotlib.pyplot as plt

    rows = _rows()
    for step, (r, sat, n) in {2: (0.0, 0.0, 0), 6: (3.0, -2.0, 1), 10: (5.0, -4.0, 1)}.items():
        rows[step - 1].update({"val_shift/reward_total": r, "val_shift/saturation": sat, "val_shift/VQ": r / 2,
                               "val/hacking_warnings": n})
    fig = curves_figure(rows)
    try:
        ax_h = fig.axes[-1]
        assert _line(ax_h, "trained reward") == ([2, 6, 10], [0.0, 3.0, 5.0])
        assert _line(ax_h, "saturation") == ([2, 6, 10], [0.0, -2.0, -4.0])
        assert _line(ax_h, "VQ")[1] == [0.0, 1.5, 2.5]
        assert [ln.get_xdata()[0] for ln in ax_h.lines if ln.get_label() == "hacking warning"] == [6]
    finally:
        plt.close(fig)
    fig = curves_figure(_rows())
    try:
        assert [t.get_text() for t in fig.axes[-1].texts] == ["not logged in this run"]
    finally:
        plt.close(fig)


@pytest.mark.parametrize("n", [4, 14, 25])
def test_no_two_held_out_lines_look_alike(n):
    """A world run logs more held-out metrics than matplotlib's 10-colour cycle: every line of the bottom panel has
    its own (colour, line style), none the trained reward's black."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    rows = _rows()
    for step in (2, 6, 10):
        rows[step - 1].update({"val_shift/reward_total": step / 10, "val/hacking_warnings": 0,
                               **{f"val_shift/metric_{i:02d}": -i * step / 100 for i in range(n)}})
    fig = curves_figure(rows)
    try:
        lines = [ln for ln in fig.axes[-1].lines if ln.get_label().startswith("metric_")]
        looks = {(to_rgba(ln.get_color()), ln.get_linestyle()) for ln in lines}
        assert len(lines) == n and len(looks) == n
        assert (to_rgba("black"), "-") not in looks
    finally:
        plt.close(fig)


def test_plot_curves_script_redraws_a_runs_curves_from_its_metrics(tmp_path, capsys):
    """scripts/plot_curves.py: curves.png of a run folder (or a metrics.jsonl) drawn again, by default beside it;
    a folder without metrics is one line."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import plot_curves as script

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert script.main(["--run", str(run)]) == run / "curves.png"
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "other.png"
    assert script.main(["--run", str(run / "metrics.jsonl"), "--out", str(other)]) == other and other.is_file()
    assert str(other) in capsys.readouterr().out
    with pytest.raises(SageGRPOError, match="no metrics.jsonl"):
        script.main(["--run", str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(SageGRPOError, match="no rows"):
        script.main(["--run", str(tmp_path / "empty")])


def test_frame_strip_picks_evenly_spaced_frames_side_by_side():
    frames = torch.arange(20, dtype=torch.float32).div(19).view(20, 1, 1, 1).expand(20, 3, 320, 480)
    strip = frame_strip(frames)
    h, w = STRIP_HEIGHT, 480 * STRIP_HEIGHT // 320
    assert strip.shape == (3, h, STRIP_FRAMES * w)
    firsts = strip[0, 0, ::w] * 19
    assert firsts.round().tolist() == [0, 3, 5, 8, 11, 14, 16, 19]  # first to last, evenly spaced
    small = torch.rand(3, 3, 8, 8)
    assert torch.equal(frame_strip(small), torch.cat(list(small), dim=2))  # never upscaled or padded


def _events(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_gets_scalars_video_strips_and_the_config(tmp_path):
    log = MetricsLogger(tmp_path, report_to="tensorboard", config={"optim": {"learning_rate": 3e-5}})
    log.log(2, {"reward/total_mean": 0.5, "val/reward_total": 0.25})
    log.log_videos(2, {"0000_a_red_ball": torch.rand(5, 3, 16, 24)})
    log.close()
    acc = _events(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("val/reward_total")] == [(2, 0.25)]
    (img,) = acc.Images("samples/0000_a_red_ball")
    assert (img.step, img.height, img.width) == (2, 16, 5 * 24)
    (text,) = acc.Tensors("config/text_summary")
    assert "learning_rate: 3.0e-05" in text.tensor_proto.string_val[0].decode()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2]


def test_a_resume_drops_the_interrupted_runs_later_steps_in_tensorboard_too(tmp_path):
    first = MetricsLogger(tmp_path, report_to="tensorboard")
    for step in (1, 2, 3):  # checkpoint-1 was the last one saved before the run died at step 3
        first.log(step, {"reward/total_mean": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, report_to="tensorboard", resume_step=1)
    resumed.log(2, {"reward/total_mean": 20.0})
    resumed.close()
    expected = [(1, 1.0), (2, 20.0)]
    assert [(e.step, e.value) for e in _events(tmp_path / "tensorboard").Scalars("reward/total_mean")] == expected
    assert [(r["step"], r["reward/total_mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == expected


def test_wandb_gets_video_strips_as_images(tmp_path, monkeypatch):
    logged = []
    run = types.SimpleNamespace(log=lambda data, step: logged.append((step, data)), finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kw: run, Image=lambda array, caption: ("Image", array.shape, caption))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(tmp_path, report_to="wandb", config={"a": 1})
    log.log_videos(3, {"0001_x": torch.rand(9, 3, 8, 10)})
    assert logged == [(3, {"samples/0001_x": ("Image", (8, STRIP_FRAMES * 10, 3), "samples/0001_x")})]


def test_a_missing_sink_is_one_line(monkeypatch):
    for name in ("wandb", "tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
        with pytest.raises(SageGRPOError, match=f"--report_to {name} needs the {name} package"):
            check_report_to(name)
