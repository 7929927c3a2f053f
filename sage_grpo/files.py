"""The usual file modes for what the project writes.

safetensors (0.8 here) writes each file through a private temporary file that it renames, so the file keeps that
temporary's mode, 0600: only its owner can read it. Every weight file goes through safetensors (checkpoints' RNG
state and adapters, exported models, the text-embedding cache, converted and tiny models), so without this an
exported model is unreadable to a colleague, a serving job under another user or a shared cache reader, while the
mp4s, prompts and JSON beside it are readable (open() creates 0666 less the umask). `usual_permissions` gives
files and folders the mode open() and mkdir() would have given them."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["umask", "usual_permissions"]


def umask() -> int:
    """The process umask, read without changing it where Linux reports it (os.umask can only be read by setting
    it, which races with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_permissions(path: str | Path) -> Path:
    """Files 0666 and folders 0777, less the umask, for `path` and, when it is a folder, everything under it."""
    path, mask = Path(path), umask()
    targets = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in targets:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
    return path

