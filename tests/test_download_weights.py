"""download_weights.sh: argument checks before anything is created, --dry-run, and the metrics target."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "download_weights.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path, *args):
    env = {**os.environ, "CKPTS": str(tmp_path / "ck"), "PATH": "/usr/bin:/bin"}  # no `hf` on this PATH
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=60)


@pytest.mark.parametrize("args, message", [(["bogus"], "unknown argument 'bogus'"),
                                           (["reward", "metrics"], "give one target")])
def test_bad_arguments_are_refused_before_anything_is_created(tmp_path, args, message):
    r = _run(tmp_path, *args)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ckpts").exists()


def test_dry_run_prints_the_commands_only(tmp_path):
    r = _run(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "hf download hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v" in r.stdout
    assert "hf download KlingTeam/VideoReward" in r.stdout and "dry run: nothing was downloaded" in r.stdout
    assert not (tmp_path / "ck").exists()


def test_metrics_target_fills_the_folders_score_videos_reads(tmp_path):
    from sage_grpo.rewards.clip_metrics import HUB_IDS

    r = _run(tmp_path, "metrics", "--dry-run")
    assert r.returncode == 0, r.stderr
    ck = tmp_path / "ck"
    for hub, folder in ((HUB_IDS["clipscore"][0], "clip-vit-large-patch14"), (HUB_IDS["pickscore"][0], "PickScore_v1"),
                        (HUB_IDS["pickscore"][1], "CLIP-ViT-H-14-laion2B-s32B-b79K")):
        line = next(x for x in r.stdout.splitlines() if f"hf download {hub} " in x)
        assert line.rstrip().endswith(f"--local-dir {ck / folder}")


@pytest.mark.skipif(shutil.which("hf", path="/usr/bin:/bin") is not None, reason="hf is installed system-wide")
def test_missing_hf_cli_is_one_error(tmp_path):
    r = _run(tmp_path, "reward")
    assert r.returncode == 1 and "the 'hf' CLI is missing" in r.stderr and not (tmp_path / "ck").exists()


@pytest.mark.skipif(shutil.which("modelscope", path="/usr/bin:/bin") is not None, reason="modelscope is installed")
def test_authors_layout_without_modelscope_ends_with_what_is_missing(tmp_path):
    """A stub `hf` that 'downloads' one file per pattern; no modelscope: the run ends with exit 1 and a last line
    naming Glyph-SDXL-v2 (it ended "done" with the checkpoint incomplete)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "hf").write_text("""#!/usr/bin/env bash
dest=""; pats=(); dry=0
while [ $# -gt 0 ]; do case "$1" in --local-dir) dest="$2"; shift ;; --include) pats+=("$2"); shift ;;
  --dry-run) dry=1 ;; esac; shift; done
[ "$dry" = 1 ] && exit 0
[ "${#pats[@]}" -gt 0 ] || pats=(file)
for p in "${pats[@]}"; do f="$dest/${p//\\*/x}"; mkdir -p "$(dirname "$f")"; : > "$f"; done
""")
    (bin_ / "hf").chmod(0o755)
    env = {**os.environ, "CKPTS": str(tmp_path / "ck"), "PATH": f"{bin_}:/usr/bin:/bin"}
    r = subprocess.run(["bash", str(SCRIPT), "authors"], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=60)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "done" not in r.stdout.strip().splitlines()[-1], r.stdout + r.stderr
    assert last.startswith("error: incomplete") and "Glyph-SDXL-v2" in last and "modelscope" in last, last


def test_every_supported_version_downloads_and_i2v_brings_its_image_encoder(tmp_path):
    """VERSION takes exactly the names sage_grpo knows (VARIANTS); the authors' layout of an I2V version fetches
    FLUX.1-Redux-dev's SigLIP into vision_encoder/siglip (where the loader reads it); unsupported and unknown names
    are one error before anything is created."""
    from sage_grpo.models.tiny import VARIANTS

    def run(version, *args):
        env = {**os.environ, "CKPTS": str(tmp_path / "ck"), "PATH": "/usr/bin:/bin", "VERSION": version}
        return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=60)

    for version in VARIANTS:
        r = run(version, "authors")
        assert r.returncode == 0, (version, r.stderr)
        siglip = "hf download black-forest-labs/FLUX.1-Redux-dev" in r.stdout
        assert siglip == ("i2v" in version), version
        assert (f"--local-dir {tmp_path / 'ck' / 'vision_encoder' / 'siglip'}" in r.stdout) == siglip
        assert f"HunyuanVideo-1.5-Diffusers-{version}" in run(version).stdout
    bad = run("720p_i2v_distilled_sparse")
    assert bad.returncode == 2 and "not supported: sparse attention" in bad.stderr
    unknown = run("480p_iv2")
    assert unknown.returncode == 2 and f"valid: {' '.join(VARIANTS)}" in unknown.stderr
    assert not (tmp_path / "ck").exists()
