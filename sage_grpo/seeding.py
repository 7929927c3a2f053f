"""Hash-based seeds: every random draw of a run (initial noise, SDE noise, timestep permutations, prompt shuffles)
gets its own generator seeded from integers that name it, so results do not depend on batch composition, rank
count or RNG lockstep, and a resume needs no RNG state for them."""

from __future__ import annotations

import hashlib
import struct

__all__ = ["derive_seed", "text_seed", "prompt_noise_seed"]


def derive_seed(*parts: int) -> int:
    """Deterministic 63-bit seed from integers (the same on every process and platform)."""
    data = struct.pack(f"<{len(parts)}q", *(int(p) for p in parts))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def text_seed(text: str) -> int:
    """63-bit digest of a string."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") & ((1 << 63) - 1)


def prompt_noise_seed(prompt: str, seed: int | None, index: int, image: str | None = None) -> int:
    """The per-prompt part of every noise seed: the prompt file's `seed` column (else the row index) together with
    the prompt text and, for image-to-video, `image` (the reference image's content digest), so two different
    prompts never share noise even when their seed columns are equal: not two captions, nor one caption with two
    images. (The training loop adds the group's position in its step, so that a prompt drawn twice in one step
    gets two noises.)"""
    return derive_seed(seed if seed is not None else index, text_seed(prompt), *([text_seed(image)] if image else []))
