"""Prompt files: CSV (column `prompt`, optional `index`, `seed`, `ref_image_path`), .txt (one prompt per line) and
.jsonl (objects with `prompt`, optional `index`/`seed`/`ref_image_path`). Bad files fail with a message that says
what to fix.

`ref_image_path` is the reference image of an image-to-video prompt, relative to the prompt file's folder unless
absolute; records carry it resolved. A file holds one task: every row has an image (I2V) or none does (T2V), since
the transformer decides the task once per forward and a run trains one checkpoint of one task."""

from __future__ import annotations

import csv
import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sage_grpo.errors import SageGRPOError

__all__ = ["GroupSampler", "PromptRecord", "read_prompts"]


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    index: int  # stable id: the file's `index` column, else the 0-based row number
    seed: int | None = None  # per-prompt seed from the file, if any
    ref_image_path: str | None = None  # reference image (I2V), resolved against the prompt file's folder


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
    if path.is_dir():
        raise SageGRPOError(f"prompt file {path} is a folder; give a .csv, .txt or .jsonl file")
    if not path.is_file():
        raise SageGRPOError(f"prompt file not found: {path}")
    try:
        return _records(path, _rows(path))
    except UnicodeDecodeError as e:
        raise SageGRPOError(f"{path} is not UTF-8 text (byte {e.start}); save the prompt file as UTF-8") from None
    except OSError as e:
        raise SageGRPOError(f"prompt file {path} cannot be read ({e.strerror or e})") from None


def _rows(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    rows: list[dict] = []
    if suffix == ".txt":
        lines = path.read_text(encoding="utf-8").splitlines()
        rows = [{"prompt": line.strip()} for line in lines if line.strip()]
    elif suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise SageGRPOError(f"{path}: empty file; a prompt CSV needs a header with a `prompt` column")
            if "prompt" not in reader.fieldnames:
                raise SageGRPOError(f"{path}: a prompt CSV needs a header with a `prompt` column, got "
                                    f"{reader.fieldnames}")
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
        raise SageGRPOError(f"{path}: unsupported prompt file type {suffix!r}; use .csv (column `prompt`), .txt or "
                            ".jsonl")
    return rows


def _image_field(value, base: Path, where: str) -> str | None:
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    if not isinstance(value, str):
        raise SageGRPOError(f"{where}: ref_image_path must be a path (text), got {value!r}")
    p = Path(value.strip()).expanduser()
    return str(p if p.is_absolute() else (base / p))


def _records(path: Path, rows: list[dict]) -> list[PromptRecord]:
    records = []
    base = path.resolve().parent
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
                ref_image_path=_image_field(row.get("ref_image_path"), base, where),
            )
        )
    if not records:
        raise SageGRPOError(f"{path}: no prompts")
    with_image = [r for r in records if r.ref_image_path]
    if with_image and len(with_image) < len(records):
        first = next(n for n, r in enumerate(records, 1) if not r.ref_image_path)
        raise SageGRPOError(f"{path} mixes tasks: {len(with_image)} prompts have a ref_image_path (image-to-video) "
                            f"and {len(records) - len(with_image)} do not (text-to-video; the first is prompt "
                            f"{first}); give every prompt an image, or none")
    return records


class GroupSampler:
    """The prompts of each training step, G copies each, laid out over the data-parallel ranks.

    A step takes `batch_size * dp_size / G` prompts from an epoch-wise permutation of the prompt list (drawn from
    seed and epoch; an epoch boundary falls inside a step when the count does not divide). The step's videos are
    the prompts repeated G times in order, [p0 x G, p1 x G, ...], and data-parallel rank r takes positions
    r * batch_size ... (r + 1) * batch_size: a group may span consecutive ranks (reference_system.md). Every rank
    computes the same plan from (seed, epoch, position), so nothing is broadcast.

    buckets: a key per prompt (image-to-video: its latent size), or None. A rollout batch stacks latents of one
    shape, so each step draws all its prompts from one bucket: bucket b with probability n_b / N (its share of the
    prompts, so every prompt is drawn as often as without buckets, in expectation), chosen from (seed, step) alone,
    the same on every rank without a collective. Each bucket walks its own epoch-wise permutation (bucket 0 the one
    above, the others seeded with their index too). With one bucket the draw is the unbucketed one.

    `state_dict`: (epoch, position) with one bucket; with several, the step count and each bucket's (epoch,
    position).
    """

    def __init__(self, num_prompts: int, *, batch_size: int, num_generations: int, dp_size: int, seed: int,
                 buckets: Sequence[Hashable] | None = None):
        videos = batch_size * dp_size
        if videos % num_generations:
            raise ValueError(f"batch_size * dp_size = {videos} is not a multiple of num_generations {num_generations}")
        if num_prompts < 1:
            raise ValueError("no prompts")
        if buckets is not None and len(buckets) != num_prompts:
            raise ValueError(f"{len(buckets)} bucket keys for {num_prompts} prompts")
        self.num_prompts, self.batch_size, self.g, self.seed = num_prompts, batch_size, num_generations, seed
        self.prompts_per_step = videos // num_generations
        members: dict = {}  # bucket key -> its prompt indices, buckets in order of first appearance
        for i, key in enumerate(buckets if buckets is not None else [None] * num_prompts):
            members.setdefault(key, []).append(i)
        self.members = list(members.values())  # [bucket][prompt indices]
        self.epochs, self.positions = [0] * len(self.members), [0] * len(self.members)
        self.steps = 0  # steps drawn: the bucket choice's counter

    def _permutation(self, bucket: int, epoch: int) -> list[int]:
        import torch

        from sage_grpo.seeding import derive_seed

        n = len(self.members[bucket])
        gen = torch.Generator().manual_seed(derive_seed(self.seed, epoch, 0x5A4D, *([bucket] if bucket else [])))
        return [self.members[bucket][i] for i in torch.randperm(n, generator=gen).tolist()]

    def bucket_of_step(self, step: int) -> int:
        """The bucket step `step` draws from: b with probability n_b / N, from (seed, step) alone (integer
        arithmetic on a 63-bit hash: the same on every rank and platform)."""
        if len(self.members) == 1:
            return 0
        from sage_grpo.seeding import derive_seed

        r = derive_seed(self.seed, step, 0xB0C7) % self.num_prompts  # uniform over the prompts (bias < 2^-40)
        for b, m in enumerate(self.members):
            if r < len(m):
                return b
            r -= len(m)
        raise AssertionError("unreachable: the buckets hold every prompt")

    def next_step(self) -> list[int]:
        """Advance one step -> the step's prompt indices (prompts_per_step of them, the group ids' order)."""
        b = self.bucket_of_step(self.steps)
        self.steps += 1
        n, out = len(self.members[b]), []
        while len(out) < self.prompts_per_step:
            perm = self._permutation(b, self.epochs[b])
            take = min(self.prompts_per_step - len(out), n - self.positions[b])
            out += perm[self.positions[b] : self.positions[b] + take]
            self.positions[b] += take
            if self.positions[b] == n:
                self.epochs[b], self.positions[b] = self.epochs[b] + 1, 0
        return out

    def rank_slice(self, step_prompts: list[int], dp_rank: int) -> list[tuple[int, int, int]]:
        """This rank's videos of a step -> [(group index within the step, prompt index, generation 0..G-1)]."""
        videos = [(gi, p, gen) for gi, p in enumerate(step_prompts) for gen in range(self.g)]
        return videos[dp_rank * self.batch_size : (dp_rank + 1) * self.batch_size]

    def state_dict(self) -> dict:
        if len(self.members) == 1:  # the unbucketed sampler's state, as checkpoints before buckets hold it (the
            # step count only chooses among buckets)
            return {"epoch": self.epochs[0], "position": self.positions[0]}
        return {"steps": self.steps, "buckets": [[e, p] for e, p in zip(self.epochs, self.positions)]}

    def load_state_dict(self, state: dict) -> None:
        saved = len(state["buckets"]) if "buckets" in state else 1
        if saved != len(self.members):
            raise SageGRPOError(f"the checkpoint's prompt sampler has {saved} size bucket(s), this run's prompts "
                                f"have {len(self.members)}: resume with the prompt file and images the run started "
                                "with")
        if "buckets" in state:
            self.steps = int(state["steps"])
            self.epochs = [int(e) for e, _ in state["buckets"]]
            self.positions = [int(p) for _, p in state["buckets"]]
        else:
            self.epochs, self.positions = [int(state["epoch"])], [int(state["position"])]
