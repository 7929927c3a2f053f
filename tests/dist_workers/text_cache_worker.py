"""torchrun worker for tests/test_models_text_cache.py: the shared precompute of the text-embedding cache on 2 gloo
ranks (memory only and through a shared cache directory). argv: out_dir, tiny model dir, cache dir. Writes one JSON
per rank to out_dir."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sage_grpo.errors import SageGRPOError  # noqa: E402
from sage_grpo.models.loading import load_pipeline  # noqa: E402
from sage_grpo.models.text_cache import TextEmbeddingCache  # noqa: E402
from sage_grpo.parallel.dist import barrier, destroy, init_distributed  # noqa: E402

torch.set_num_threads(1)
out_dir, model_dir, cache_dir = (Path(a) for a in sys.argv[1:4])
info = init_distributed()
pipe = load_pipeline(model_path=str(model_dir), dtype="fp32")
distinct = [f"prompt number {i}" for i in range(6)] + ['a sign that says "OPEN"']  # 7: shares of 4 and 3
prompts = distinct + distinct[:3]  # repeats are encoded once
out = {"rank": info.rank}


def valid_equal(c, i, ref) -> bool:
    """Row i of a cached batch holds exactly the valid tokens of the pipeline's own (padded) encoding."""
    pe, pm, be, bm = ref
    n1, n2 = int(pm.sum()), int(bm.sum())
    return (torch.equal(c.prompt_embeds[i, :n1], pe[0, :n1]) and torch.equal(c.byt5_embeds[i, :n2], be[0, :n2])
            and int(c.prompt_mask[i].sum()) == n1 and int(c.byt5_mask[i].sum()) == n2)


# memory only: each rank encodes its share, the trimmed tensors are all-gathered
mem = TextEmbeddingCache(pipe, "cpu", torch.float32)
mem.precompute(prompts, info)
out["mem_encoded"], out["mem_len"] = mem.num_encoded, len(mem)
got = mem.get(distinct)
refs = [pipe.encode_prompt(prompt=[p], device="cpu", dtype=torch.float32, batch_size=1) for p in distinct]
out["mem_equal_to_pipeline"] = all(valid_equal(got, i, r) for i, r in enumerate(refs))
out["mem_encoded_after_get"] = mem.num_encoded  # everything came from the precompute

# through a shared directory: each rank writes its share; nothing stays in memory
disk = TextEmbeddingCache(pipe, "cpu", torch.float32, cache_dir)
disk.precompute(prompts, info)
out["disk_encoded"], out["disk_memory_bytes"], out["disk_len"] = disk.num_encoded, disk.memory_bytes, len(disk)
fields = lambda c: (c.prompt_embeds, c.prompt_mask, c.byt5_embeds, c.byt5_mask)  # noqa: E731
out["disk_equal_to_memory"] = all(torch.equal(a, b) for a, b in zip(fields(got), fields(disk.get(distinct))))
out["disk_encoded_after_get"] = disk.num_encoded
again = TextEmbeddingCache(pipe, "cpu", torch.float32, cache_dir)
again.precompute(prompts, info)
out["again_encoded"] = again.num_encoded
barrier()
out["files"] = len(list(cache_dir.glob("*.safetensors")))
out["tmp_files"] = len(list(cache_dir.glob("*.tmp")))

# different lists on the ranks: one clear error on every rank, no hang
try:
    TextEmbeddingCache(pipe, "cpu", torch.float32).precompute([f"only on rank {info.rank}"], info)
except SageGRPOError as e:
    out["mismatch_error"] = str(e)

# a failure on one rank (here: rank 1 cannot encode) is raised on every rank, not left to a collective timeout
failing = TextEmbeddingCache(pipe, "cpu", torch.float32)
if info.rank == 1:
    def refuse(prompt):
        raise SageGRPOError(f"cannot encode {prompt!r}")
    failing._encode = refuse
try:
    failing.precompute(["x", "y", "z", "w"], info)
except SageGRPOError as e:
    out["failure_error"] = str(e)

(out_dir / f"rank{info.rank}.json").write_text(json.dumps(out))
barrier()  # every rank done before any closes its connections (gloo aborts a peer still using them)
destroy()
