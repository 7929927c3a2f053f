"""Rewards by import path (`--reward_model package.module:factory` / `path/to/file.py:factory`): the shipped
example, every user error as one line before the policy loads, weights, held-out metrics, score_videos.py, and a
plugin reward that trains the tiny model exactly as the same reward registered in the package."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import smooth_videos
from post_train_helpers import ROOT, _args, _stable, pt

from sage_grpo.errors import SageGRPOError
from sage_grpo.heldout import HeldOut, parse_validation_metrics
from sage_grpo.metrics import read_metrics
from sage_grpo.rewards import build_reward
from sage_grpo.rewards.base import check_first_call, get_reward_builder

EXAMPLE = "examples/rewards/colorfulness.py:build"


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # file paths of import paths are relative to the working directory


def _plugin(tmp_path, body: str, name: str = "myreward.py") -> str:
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return str(f)


def test_the_example_reward_scores_colourfulness(in_root):
    reward = get_reward_builder(EXAMPLE)(device="cpu", dtype="fp32")
    grey = torch.full((1, 3, 3, 8, 8), 0.5)
    red = torch.zeros(1, 3, 3, 8, 8)
    red[:, :, 0] = 1.0
    half = torch.rand(1, 3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    out = reward(torch.cat([grey, red, half]), ["a", "b", "c"])["colorfulness"]
    assert out[0] == 0  # no chroma
    # pure red: rg = 1, yb = 0.5, no spread -> 0.3 * sqrt(1.25)
    torch.testing.assert_close(out[1], torch.tensor(0.3 * 1.25**0.5))
    assert 0 < out[2] < out[1] + 1 and torch.equal(out, reward(torch.cat([grey, red, half]), ["a", "b", "c"])[
        "colorfulness"])  # deterministic
    check_first_call(reward, EXAMPLE, smooth_videos(2), ["a", "b"])


def test_import_paths_combine_with_registered_names_and_take_weights(in_root, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    _plugin(tmp_path / "my_rewards_pkg", """
        import torch
        class Dark:
            components = ("darkness",)
            default_weights = {"darkness": 1.0}
            def __call__(self, videos, prompts):
                return {"darkness": 1 - videos.mean(dim=(1, 2, 3, 4))}
        def Make(**kw):
            assert "device" in kw and "sample_fps" in kw  # the built-in builders' keyword arguments
            return Dark()
    """, "Dark.py")
    # import paths keep their case (registered names do not): a module and a factory with capitals
    r = build_reward(f"{EXAMPLE},my_rewards_pkg.Dark:Make,BRIGHTNESS",
                     reward_weights='{"colorfulness":2,"Darkness":0.5,"brightness":0}')
    assert r.components == ("colorfulness", "darkness", "brightness")
    assert list(r.rewards) == [EXAMPLE, "my_rewards_pkg.Dark:Make", "brightness"]
    assert parse_validation_metrics(["my_rewards_pkg.Dark:Make"], ["brightness"], ["a"]).rewards == (
        "my_rewards_pkg.Dark:Make",)  # built again from this name for validation
    v = smooth_videos(2)
    out = r(v, ["a", "b"])
    torch.testing.assert_close(out["total"], 2 * out["colorfulness"] + 0.5 * out["darkness"])
    torch.testing.assert_close(out["darkness"], 1 - v.mean(dim=(1, 2, 3, 4)))


@pytest.mark.parametrize("spec, body, match", [
    ("nowhere/missing.py:build", None, r"file nowhere/missing.py not found \(relative to the working directory"),
    ("no_such_module_xyz.sub:build", None, r"module 'no_such_module_xyz.sub' not found"),
    ("{f}:build", "import no_such_dependency_xyz\n", r"needs module 'no_such_dependency_xyz'|importing .* failed "
                                                     r"\(ModuleNotFoundError"),
    ("{f}:build", "x = 1 / 0\n", r"importing .*myreward.py failed \(ZeroDivisionError: division by zero\)"),
    ("{f}:buidl", "def build(**kw):\n    pass\n", r"has no attribute 'buidl' \(callables there: build\)"),
    ("{f}:build", "build = 3\n", r"is a int, not a factory"),
    ("{f}:build", "def build(**kw):\n    raise OSError('weights\\nmissing')\n",
     r"the factory raised OSError: weights missing$"),
    ("{f}:build", "def build(**kw):\n    return 42\n", r"returned int, not a Reward \(missing components, "
                                                       r"default_weights, __call__"),
    ("{f}:build", "class R:\n    components = 'x'\n    default_weights = {}\n    def __call__(self, v, p):\n"
                  "        pass\ndef build(**kw):\n    return R()\n", r"components must be a non-empty tuple"),
    ("{f}:build", "class R:\n    components = ('x',)\n    default_weights = {'y': 1}\n    def __call__(self, v, p):\n"
                  "        pass\ndef build(**kw):\n    return R()\n", r"default_weights must map some of its"),
])
def test_each_user_error_is_one_line(tmp_path, spec, body, match):
    if body is not None:
        spec = spec.format(f=_plugin(tmp_path, body))
    with pytest.raises(SageGRPOError, match=match) as err:
        get_reward_builder(spec)(device="cpu")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("ret, match", [
    ("{'other': torch.zeros(len(p))}", r"a first call returned no 'score' \(got \['other'\]"),
    ("{'score': torch.zeros(())}", r"component 'score' of a first call on 2 videos is \(\), expected .* \(2,\)"),
    ("{'score': torch.zeros(len(p), 1)}", r"is \(2, 1\), expected"),
    ("{'score': [0.0, 1.0]}", r"is list, expected a tensor"),
    ("torch.zeros(2)", r"must return \{component: tensor \[B\]\}, got Tensor"),
    ("{'score': v.reshape(5, -1)}", r"a first call on 2 test videos \(2, 9, 3, 32, 48\) raised RuntimeError"),
])
def test_a_first_call_with_missing_components_or_wrong_shapes_is_one_line(tmp_path, ret, match):
    spec = _plugin(tmp_path, f"""
        import torch
        class R:
            components = ("score",)
            default_weights = {{"score": 1.0}}
            def __call__(self, v, p):
                return {ret}
        def build(**kw):
            return R()
    """, "firstcall.py") + ":build"
    reward = get_reward_builder(spec)()
    with pytest.raises(SageGRPOError, match=match) as err:
        check_first_call(reward, spec, smooth_videos(2), ["a", "b"])
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_post_train_refuses_a_broken_plugin_in_one_line_before_any_model_loads(tmp_path):
    """The CLI: exit 2, one `error:` message, no traceback (preflight imports the file); the missing model of the
    same launch is named in the same message, a bullet each (one round of errors)."""
    bad = _plugin(tmp_path, "def build(**kw):\n    pass\n")
    run = subprocess.run([sys.executable, str(ROOT / "post_train.py"), *_args(tmp_path / "no_model", tmp_path / "o",
                          "--reward_model", f"{bad}:nope")], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[0] == "error: 2 things to fix before the run can start:" and "Traceback" not in run.stderr
    assert f"  - --reward_model {bad}:nope: {bad} has no attribute 'nope' (callables there: build)" in lines
    assert any("no HunyuanVideo-1.5 checkpoint" in x for x in lines) and len(lines) == 3


def test_a_plugin_whose_first_call_fails_stops_before_the_policy_loads(tiny_model, tmp_path, monkeypatch):
    spec = _plugin(tmp_path, """
        class R:
            components = ("score",)
            default_weights = {"score": 1.0}
            def __call__(self, v, p):
                return {"score": v.mean()}
        def build(**kw):
            return R()
    """) + ":build"

    def never(*a, **k):
        raise AssertionError("the policy was loaded before the reward was checked")

    monkeypatch.setattr(pt, "load_policy", never)
    with pytest.raises(SageGRPOError, match=r"component 'score' of a first call on 2 videos is \(\)"):
        pt.main(_args(tiny_model, tmp_path / "run", "--reward_model", spec, "--reward_weights", ""))


def test_held_out_metrics_and_score_videos_take_a_plugin(in_root, tmp_path):
    spec = parse_validation_metrics(["statistics", EXAMPLE], ["brightness"], ["a"])
    assert spec.rewards == (EXAMPLE,)
    trained = build_reward("brightness", reward_weights="")
    held = HeldOut(spec, trained, {EXAMPLE: get_reward_builder(EXAMPLE)()})
    v = smooth_videos(1)
    scores = held.score(v[0], "a", {"brightness": 0.5}, None)
    assert scores["colorfulness"] == pytest.approx(float(get_reward_builder(EXAMPLE)()(v, ["a"])["colorfulness"][0]))
    with pytest.raises(SageGRPOError, match="that reward is trained"):
        parse_validation_metrics([EXAMPLE], [f" {EXAMPLE}", "brightness"], ["a"])
    with pytest.raises(SageGRPOError, match="file nowhere.py not found"):
        parse_validation_metrics(["nowhere.py:build"], ["brightness"], ["a"])

    from helpers import load_script

    from sage_grpo.video import write_video

    d = tmp_path / "vids"
    d.mkdir()
    write_video(d / "a.mp4", v[0])
    sv = load_script("score_videos")
    assert sv.main(["--videos", str(d), "--out", str(tmp_path / "t"), "--metrics", f"brightness,{EXAMPLE}"]) == 0
    header = (tmp_path / "t.csv").read_text().splitlines()[0]
    assert "colorfulness" in header and "brightness" in header


@pytest.mark.slow
def test_a_plugin_by_file_path_trains_exactly_as_the_registered_reward(tiny_model, tmp_path, monkeypatch):
    """The same reward by file path and by registered name: the same metrics, bitwise; the example trains too."""
    spec = _plugin(tmp_path, """
        from sage_grpo.rewards.builtin import BrightnessReward
        def build(**kw):
            return BrightnessReward()
    """, "bright_plugin.py") + ":build"
    pt.main(_args(tiny_model, tmp_path / "registered", "--reward_model", "brightness"))
    pt.main(_args(tiny_model, tmp_path / "plugin", "--reward_model", spec))
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("registered", "plugin"))
    assert len(a) == 2 and _stable(a) == _stable(b)
    monkeypatch.chdir(ROOT)
    pt.main(_args(tiny_model, tmp_path / "example", "--reward_model", EXAMPLE, "--reward_weights",
                  '{"colorfulness":1}', "--max_steps", "1"))
    row = read_metrics(tmp_path / "example" / "metrics.jsonl")[0]
    assert row["reward/failed"] == 0 and row["reward/colorfulness_mean"] == row["reward/total_mean"] > 0
    assert row["train/grad_norm"] > 0
