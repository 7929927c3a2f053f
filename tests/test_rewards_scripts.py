"""scripts/score_videos.py, scripts/make_tiny_videoalign.py and scripts/bench_reward.py, run in-process."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import TINY_MIN_PIXELS, load_script, smooth_videos

from sage_grpo.rewards.base import score_safely
from sage_grpo.rewards.builtin import BrightnessReward
from sage_grpo.rewards.videoalign import VideoAlignReward
from sage_grpo.video import read_video, write_video


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory):
    """Two 9-frame mp4s at 24 fps; the first has a prompt .txt, the second takes its prompt from the file name."""
    d = tmp_path_factory.mktemp("vids")
    v = smooth_videos(2, 9, 32, 48, seed=5)
    write_video(d / "fox_video.mp4", v[0])
    (d / "fox_video.txt").write_text("a red fox jumps over a log\n")
    write_video(d / "a_calm_sea.mp4", v[1])
    return d


def _args(tiny_dirs, clip, out):  # noqa: F811
    """Common score_videos flags for the tiny models."""
    return [
        "--out", str(out), "--metrics", "videoalign_local,brightness,clipscore", "--device", "cpu", "--dtype", "fp32",
        "--reward_model_path", str(tiny_dirs["old"]), "--reward_base_model_path", str(tiny_dirs["base"]),
        "--clip_model_path", str(clip["clip"]), "--min_pixels", str(TINY_MIN_PIXELS),
    ]  # fmt: skip


def test_score_videos_folder_tables(tiny_dirs, tiny_clip_dirs, video_folder, tmp_path, capsys):  # noqa: F811
    """CSV/JSON rows equal direct scoring of the decoded frames; MEAN row and JSON means are the column means."""
    sv = load_script("score_videos")
    out = tmp_path / "table"
    assert sv.main(["--videos", str(video_folder), *_args(tiny_dirs, tiny_clip_dirs, out)]) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert [Path(r["video"]).name for r in rows] == ["a_calm_sea.mp4", "fox_video.mp4", "MEAN"]
    assert rows[0]["prompt"] == "a calm sea" and rows[1]["prompt"] == "a red fox jumps over a log"
    js = json.loads(out.with_suffix(".json").read_text())
    for col in ("VQ", "MQ", "TA", "Overall", "CLIPScore", "brightness"):
        vals = [float(r[col]) for r in rows[:2]]
        assert float(rows[2][col]) == pytest.approx(sum(vals) / 2, rel=1e-6)
        assert js["means"][col] == pytest.approx(sum(vals) / 2, rel=1e-6) and js["n_failed"][col] == 0
    reward = VideoAlignReward(tiny_dirs["old"], tiny_dirs["base"], dtype=torch.float32, min_pixels=TINY_MIN_PIXELS)
    frames, _ = read_video(video_folder / "fox_video.mp4")
    direct = reward(frames[None], ["a red fox jumps over a log"])
    assert float(rows[1]["Overall"]) == pytest.approx(direct["Overall"].item(), abs=1e-6)
    assert float(rows[1]["brightness"]) == pytest.approx(BrightnessReward()(frames[None], [""])["brightness"].item())
    assert "scored 2 videos" in capsys.readouterr().out


def test_score_videos_csv_input_and_failed_video(tiny_dirs, tiny_clip_dirs, video_folder, tmp_path, capsys):  # noqa: F811
    """A prompt CSV with relative paths works; an undecodable video gets NaN (counted), not 0, not a crash."""
    sv = load_script("score_videos")
    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"not a video")
    lst = tmp_path / "list.csv"
    lst.write_text(f"prompt,video_path\nfox,{video_folder / 'fox_video.mp4'}\nbroken,broken.mp4\n")
    out = tmp_path / "t2"
    assert sv.main(["--videos", str(lst), *_args(tiny_dirs, tiny_clip_dirs, out)]) == 0
    err = capsys.readouterr().err  # one warning line for the broken video: no ffmpeg banner, no Python warning
    assert err.startswith("warning: cannot decode video") and len(err.strip().splitlines()) == 1
    assert "ffmpeg version" not in err and "RuntimeWarning" not in err
    js = json.loads(out.with_suffix(".json").read_text())
    assert js["videos"][1]["VQ"] is None and js["n_failed"]["VQ"] == 1
    assert js["means"]["VQ"] == pytest.approx(js["videos"][0]["VQ"])


@pytest.mark.parametrize(
    "videos, extra, message",
    [
        ("missing_dir", [], "does not exist"),
        ("empty_dir", [], "no .mp4 files"),
        ("bad.csv", [], "needs a 'prompt' column"),
        ("ok_folder", ["--metrics", "videoalgn"], "unknown reward 'videoalgn'"),
        ("ok_folder", ["--metrics", "videoalign_local", "--reward_model_path", "/nonexistent"], "does not exist"),
    ],
)
def test_score_videos_bad_inputs_exit_2(videos, extra, message, video_folder, tmp_path, capsys):
    """User errors: exit code 2 and one 'error:' line on stderr, no traceback."""
    sv = load_script("score_videos")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "bad.csv").write_text("text,file\nhi,x.mp4\n")
    src = video_folder if videos == "ok_folder" else tmp_path / videos
    rc = sv.main(["--videos", str(src), "--out", str(tmp_path / "o"), "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_make_tiny_cli_writes_loadable_small_checkpoint(tmp_path, capsys):
    """The CLI writes both dirs (< 3 MB together) and the result loads and scores finitely in both forms."""
    mk = load_script("make_tiny_videoalign")
    assert mk.main(["--out", str(tmp_path / "VideoReward"), "--layout", "new"]) == 0
    base = tmp_path / "Qwen2-VL-2B-Instruct"
    size = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert size < 3e6, size
    assert {p.name for p in (tmp_path / "VideoReward").iterdir()} == {
        "model_config.json",
        "checkpoint-2",
        "checkpoint-8",
    }
    v = smooth_videos(1, 5, 32, 32)
    for form in ("full", "lora"):
        r = VideoAlignReward(tmp_path / "VideoReward", base, weights_form=form, dtype=torch.float32,
                             min_pixels=TINY_MIN_PIXELS)  # fmt: skip
        out = score_safely(r, v, ["x"])
        assert all(math.isfinite(out[k].item()) for k in r.components)


@pytest.mark.slow
def test_bench_reward_runs(capsys, tmp_path):
    """The benchmark runs on the tiny model and reports medians and the speed-up (no timing assertion), also as
    the benchmark JSON report (sage_grpo/benchjson.py, as bench_step.py)."""
    import json

    bench = load_script("bench_reward")
    report = tmp_path / "bench_reward.json"
    assert bench.main(["--batch", "2", "--frames", "9", "--height", "32", "--width", "48", "--repeats", "1",
                       "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "in-memory batched" in out and "speed-up" in out
    rep = json.loads(report.read_text())
    assert rep["benchmark"] == "bench_reward" and rep["ratios"]["mp4_round_trip_over_in_memory"] > 0
    assert set(rep["results"]["seconds_median"]) == {"in_memory", "mp4_round_trip"}


# ------------------------------------------------------------------------------- score_videos.py inputs and flags


def _run(sv, argv, capsys):
    rc = sv.main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_a_failed_score_videos_leaves_no_output_folder(tmp_path, capsys):
    """No videos to score: exit 2, one line, and no --out folder (eval/) made for tables never written."""
    sv = load_script("score_videos")
    (tmp_path / "empty").mkdir()
    rc, _, err = _run(sv, ["--videos", str(tmp_path / "empty"), "--out", str(tmp_path / "eval" / "base")], capsys)
    assert rc == 2 and err.strip().count("\n") == 0 and "no .mp4 files" in err, err
    assert not (tmp_path / "eval").exists()


def test_score_videos_one_mp4_and_exact_prompt(video_folder, tmp_path, capsys):
    """A single .mp4 is scored (it used to be read as a CSV); the .txt prompt is kept exactly."""
    sv = load_script("score_videos")
    d = tmp_path / "one"
    d.mkdir()
    write_video(d / "clip.mp4", smooth_videos(1, 5, 32, 32)[0])
    (d / "clip.txt").write_text("  a dog, running \n", encoding="utf-8")
    rc, out, err = _run(sv, ["--videos", str(d / "clip.mp4"), "--out", str(tmp_path / "t"), "--metrics", "brightness",
                             "--device", "cpu"], capsys)
    assert rc == 0 and "scored 1 video -> " in out and err == ""
    rows = list(csv.DictReader((tmp_path / "t.csv").open(encoding="utf-8")))
    assert rows[0]["prompt"] == "  a dog, running "


def test_score_videos_prompt_from_file_name_is_one_warning(video_folder, tmp_path, capsys):
    sv = load_script("score_videos")
    rc, _, err = _run(sv, ["--videos", str(video_folder), "--out", str(tmp_path / "t"), "--metrics", "brightness",
                           "--device", "cpu"], capsys)
    assert rc == 0 and err.startswith("warning: 1 of 2 videos have no <name>.txt") and len(err.splitlines()) == 1


def test_score_videos_every_video_failed_exits_2(tmp_path, capsys):
    sv = load_script("score_videos")
    d = tmp_path / "bad"
    d.mkdir()
    for name in ("a.mp4", "b.mp4"):
        (d / name).write_bytes(b"not a video")
    rc, out, err = _run(sv, ["--videos", str(d), "--out", str(tmp_path / "t"), "--metrics", "brightness", "--device",
                             "cpu"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and lines[-1].startswith("error: every video failed to score (2 videos")
    assert lines[0].startswith("warning: 2 of 2 videos have no <name>.txt")
    assert all(line.startswith("warning: cannot decode video") for line in lines[1:3]) and "ffmpeg version" not in err
    assert json.loads((tmp_path / "t.json").read_text())["n_failed"] == {"brightness": 2}  # the tables are written


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "FILE/sub/table"], "is a file, not a folder"),
        (["--out", "/proc/sage_grpo_scores"], "is not writable"),
        (["--max_pixels", "0"], "--max_pixels must be >= 1"),
        (["--sample_fps", "0"], "--sample_fps must be > 0"),
        (["--video_fps", "-1"], "--video_fps must be > 0"),
        (["--min_pixels", "5000", "--max_pixels", "4000"], "--min_pixels (5000) must be <= --max_pixels (4000)"),
        (["--max_pixels", "4000"], "below VideoAlign's default --min_pixels"),
        (["--metrics", "brightness,bogus"], "unknown reward 'bogus'"),
        (["--metrics", "world_motoin"], "unknown reward 'world_motoin'; did you mean world_motion? valid names for "
                                        "--metrics are:"),
        (["--device", "tpu:x"], "--device 'tpu:x' is not a device"),
        (["--max_pixels", "lots"], "invalid int value"),
    ],
)
def test_score_videos_flags_checked_before_loading(extra, message, video_folder, tmp_path, capsys):
    """Flag errors are one line and come before any metric loads (the reward path here does not exist)."""
    sv = load_script("score_videos")
    (tmp_path / "FILE").write_text("")
    extra = [x.replace("FILE", str(tmp_path / "FILE")) for x in extra]
    argv = ["--videos", str(video_folder), "--out", str(tmp_path / "o"), "--device", "cpu", "--metrics",
            "videoalign_local", "--reward_model_path", "/nonexistent", *extra]
    rc, _, err = _run(sv, argv, capsys)
    assert rc == 2 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_score_videos_cuda_unavailable(video_folder, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    sv = load_script("score_videos")
    rc, _, err = _run(sv, ["--videos", str(video_folder), "--out", str(tmp_path / "o"), "--device", "cuda"], capsys)
    assert rc == 2 and "CUDA is not available" in err


def test_score_videos_unsupported_input_type(tmp_path, capsys):
    sv = load_script("score_videos")
    (tmp_path / "list.txt").write_text("x\n")
    rc, _, err = _run(sv, ["--videos", str(tmp_path / "list.txt"), "--out", str(tmp_path / "o"), "--device", "cpu"],
                      capsys)
    assert rc == 2 and "give a folder of .mp4 files, one .mp4 or a .csv" in err


@pytest.mark.parametrize("metric, hub", [("clipscore", "openai/clip-vit-large-patch14"),
                                         ("pickscore", "yuvalkirstain/PickScore_v1")])
def test_missing_clip_weights_name_the_hub_id(metric, hub, video_folder, tmp_path, capsys):
    sv = load_script("score_videos")
    rc, _, err = _run(sv, ["--videos", str(video_folder), "--out", str(tmp_path / "o"), "--device", "cpu",
                           "--metrics", metric, "--pretrained_model_root", str(tmp_path)], capsys)
    assert rc == 2 and f"download {hub} there" in err and "download_weights.sh metrics" in err


@pytest.mark.parametrize("argv, message", [(["--batch", "0"], "--batch must be >= 1"),
                                           (["--dtype", "fp64"], "invalid choice"),
                                           (["--reward_model_path", "x"], "give both")])
def test_bench_reward_flags_are_checked(argv, message):
    from sage_grpo.errors import SageGRPOError

    with pytest.raises(SageGRPOError, match=message):
        load_script("bench_reward").main(argv)


def test_make_tiny_videoalign_checks_out_first(tmp_path):
    from sage_grpo.errors import SageGRPOError

    (tmp_path / "f").write_text("")
    with pytest.raises(SageGRPOError, match="is a file, not a folder"):
        load_script("make_tiny_videoalign").main(["--out", str(tmp_path / "f" / "VideoReward")])
