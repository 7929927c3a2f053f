"""scripts/convert_authors_checkpoint.py's --out checks: a folder that would damage or mislabel a checkpoint is one
error before anything is written; --overwrite replaces an earlier conversion and nothing else."""

from __future__ import annotations

import json

import pytest
from helpers import load_script

from sage_grpo.errors import SageGRPOError


def _tree(root):
    """Every path under root with its size and modification time: what a refused run must leave as it was."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def convert():
    main = load_script("scripts/convert_authors_checkpoint.py").main
    return lambda root, out, *extra: main(["--pretrained_model_root", str(root), "--out", str(out), "--dtype", "fp32",
                                           *extra])


def test_out_in_the_authors_root_is_refused_and_nothing_is_written(convert, tiny_authors_dir, tmp_path):
    """The root itself (also through a symlink, and with --overwrite), one of its folders, and the folder where
    load_pipeline looks for another version: refused, the authors' files untouched."""
    before = _tree(tiny_authors_dir)
    link = tmp_path / "link"
    link.symlink_to(tiny_authors_dir, target_is_directory=True)
    for out, extra, why in [
        (tiny_authors_dir, (), "itself"),
        (link, ("--overwrite",), "itself"),  # the same folder by another name
        (tiny_authors_dir / "vae", ("--overwrite",), "inside"),
        (link / "converted", (), "inside"),  # a new folder inside: not where load_pipeline looks for 480p_t2v
        (tiny_authors_dir / "HunyuanVideo-1.5-Diffusers-720p_t2v", (), "inside"),  # found for 720p_t2v
    ]:
        with pytest.raises(SageGRPOError, match=why):
            convert(tiny_authors_dir, out, *extra)
    assert _tree(tiny_authors_dir) == before


def test_non_empty_out_needs_overwrite_and_an_earlier_conversion(convert, tiny_authors_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "model_index.json").write_text("{}")
    before = _tree(tmp_path)
    with pytest.raises(SageGRPOError, match="no earlier conversion"):
        convert(tiny_authors_dir, other, "--overwrite")  # never replaces a folder that is not a conversion
    with pytest.raises(SageGRPOError, match="--overwrite"):
        convert(tiny_authors_dir, earlier)
    assert _tree(tmp_path) == before


def test_overwrite_replaces_an_earlier_conversion_in_the_versions_own_folder(convert, tmp_path):
    """<root>/HunyuanVideo-1.5-Diffusers-<version> (the documented place) is accepted; with --overwrite the earlier
    conversion's files are gone (a stale shard would be read beside the new weights) and the result loads as a
    diffusers layout."""
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    root = write_tiny_checkpoint(tmp_path / "authors", "authors", seed=0)  # its own: this test writes under it
    own = root / "HunyuanVideo-1.5-Diffusers-480p_t2v"
    own.mkdir()
    (own / "model_index.json").write_text("{}")
    (own / "stale-00001-of-00002.safetensors").write_text("x")
    convert(root, own, "--overwrite")
    assert not (own / "stale-00001-of-00002.safetensors").exists()
    assert json.loads((own / "converted_from.json").read_text())["version"] == "480p_t2v"
    assert load_pipeline(model_path=str(own), dtype="fp32").sage_grpo_location.layout == "diffusers"
