"""Prompt files: CSV (column `prompt`, optional `index`, `seed`, `ref_image_path`), .txt (one prompt per line) and
.jsonl (objects with `prompt`, optional `index`/`seed`). Bad files fail with a message that says what to fix."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from sage_grpo.errors import SageGRPOError

__all__ = ["PromptRecord", "read_prompts"]


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    index: int  # stable id: the file's `index` column, else the 0-based row number
    seed: int | None = None  # per-prompt seed from the file, if any
    ref_image_path: str | None = None


def _int_field(value, what: str, where: str) -> int | None:
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SageGRPOError(f"{where}: {what} must be an integer, got {value!r}") from None


def read_prompts(path: str | Path) -> list[PromptRecord]:
    """Read a prompt file -> records (empty lines / empty prompts are an error in csv/jsonl, skipped in txt)."""
    path = Path(path)
    if not path.is_file():
        raise SageGRPOError(f"prompt file not found: {path}")
    suffix = path.suffix.lower()
    rows: list[dict] = []
    if suffix == ".txt":
        lines = path.read_text(encoding="utf-8").splitlines()
        rows = [{"prompt": line.strip()} for line in lines if line.strip()]
    elif suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or "prompt" not in reader.fieldnames:
                raise SageGRPOError(f"{path}: a prompt CSV needs a header with a `prompt` column, got {reader.fieldnames}")
            rows = list(reader)
    elif suffix == ".jsonl":
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SageGRPOError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise SageGRPOError(f"{path}:{n}: each line must be an object with a `prompt` field")
            rows.append(obj)
    else:
        raise SageGRPOError(f"{path}: unsupported prompt file type {suffix!r}; use .csv (column `prompt`), .txt or .jsonl")
    records = []
    for n, row in enumerate(rows):
        where = f"{path} (prompt {n + 1})"
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise SageGRPOError(f"{where}: empty or missing prompt")
        index = _int_field(row.get("index"), "index", where)
        records.append(
            PromptRecord(
                prompt=prompt.strip(),
                index=n if index is None else index,
                seed=_int_field(row.get("seed"), "seed", where),
                ref_image_path=row.get("ref_image_path") or None,
            )
        )
    if not records:
        raise SageGRPOError(f"{path}: no prompts")
    return records
