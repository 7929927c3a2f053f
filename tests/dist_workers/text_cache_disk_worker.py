"""One of several processes writing and reading the same prompts in one text-embedding cache directory at once
(tests/test_models_text_cache.py). No model: entries are deterministic per prompt, so every read is checked.
argv: cache dir, start time (epoch seconds: all processes begin together), rounds. Exit 0 = no error."""

import hashlib
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sage_grpo.models.text_cache import TextEmbeddingCache, _Entry  # noqa: E402

torch.set_num_threads(1)
warnings.simplefilter("error")  # an unreadable file (a reader seeing a half-written one) fails this process
cache_dir, start, rounds = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
cache = TextEmbeddingCache(None, "cpu", torch.bfloat16, cache_dir)
cache._identity = "hammer"  # no pipeline: the identity is all the key needs besides the prompt


def entry(prompt: str) -> _Entry:
    g = torch.Generator().manual_seed(int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16))
    n = 1 + len(prompt) % 7
    return _Entry(torch.randn(n * 64, 256, generator=g).bfloat16(), torch.randn(n, 32, generator=g).bfloat16())


while time.time() < start:
    time.sleep(0.001)
for r in range(rounds):
    for j in range(4):
        prompt = f"round {r} prompt {j}"
        want = entry(prompt)
        cache._save_disk(prompt, want)
        got = cache._read(cache._path(prompt), prompt)
        assert got is not None and torch.equal(got.mllm, want.mllm) and torch.equal(got.byt5, want.byt5), prompt
