"""The tiny default model is built on first use at TINY_CHECKPOINT_DIR by the main rank, and only there."""

from __future__ import annotations

from pathlib import Path

from sage_grpo.models.tiny_checkpoint import TINY_CHECKPOINT_DIR, ensure_tiny_checkpoint


def test_tiny_default_is_built_once_by_the_main_rank_and_only_at_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # TINY_CHECKPOINT_DIR is relative to the working directory
    logs: list[str] = []
    ensure_tiny_checkpoint(TINY_CHECKPOINT_DIR, is_main=False, log=logs.append)
    assert not Path(TINY_CHECKPOINT_DIR).exists() and logs == []  # another rank never writes

    other = tmp_path / "elsewhere"
    ensure_tiny_checkpoint(other, is_main=True, log=logs.append)
    ensure_tiny_checkpoint("", is_main=True, log=logs.append)
    assert not other.exists() and logs == []  # any other path (or none) is left alone

    ensure_tiny_checkpoint(TINY_CHECKPOINT_DIR, is_main=True, log=logs.append)
    index = Path(TINY_CHECKPOINT_DIR) / "model_index.json"
    assert index.is_file() and len(logs) == 1 and TINY_CHECKPOINT_DIR in logs[0]
    stamp = index.stat().st_mtime_ns
    ensure_tiny_checkpoint(TINY_CHECKPOINT_DIR, is_main=True, log=logs.append)
    assert len(logs) == 1 and index.stat().st_mtime_ns == stamp  # built once
