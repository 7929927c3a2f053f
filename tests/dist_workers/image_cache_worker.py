"""torchrun worker for tests/test_i2v.py: the shared precompute of the image cache on 2 gloo ranks through a
shared cache directory. argv: out_dir, tiny I2V model dir, cache dir, image paths... (the second one missing).
Writes one JSON per rank to out_dir."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sage_grpo.errors import SageGRPOError  # noqa: E402
from sage_grpo.models.image_cond import (  # noqa: E402
    ImageConditioningCache,
    encode_reference,
    open_reference_image,
)
from sage_grpo.models.loading import load_pipeline  # noqa: E402
from sage_grpo.parallel.dist import barrier, destroy, init_distributed  # noqa: E402

torch.set_num_threads(1)
out_dir, model_dir, cache_dir = (Path(a) for a in sys.argv[1:4])
a, missing, b, c = sys.argv[4:8]
info = init_distributed()
pipe = load_pipeline(model_path=str(model_dir), dtype="fp32")
out = {"rank": info.rank}

good = [a, b, c, a]  # 3 distinct: rank 0 encodes a and c, rank 1 encodes b
cache = ImageConditioningCache(pipe, "cpu", torch.float32, cache_dir)
cache.precompute(good, info)
out["encoded"] = cache.num_encoded
got = [cache.get([p]) for p in (a, b, c)]  # one at a time: c's bucket differs
want = [encode_reference(pipe, open_reference_image(p), "cpu", torch.float32) for p in (a, b, c)]
out["equal"] = all(torch.equal(g.embeds, w.embeds) and torch.equal(g.latents, w.latents) for g, w in zip(got, want))
out["encoded_after_get"] = cache.num_encoded
out["files"] = len(list(cache_dir.glob("image-*.safetensors")))
try:  # the missing image is rank 1's share: both ranks raise, neither waits for the other
    ImageConditioningCache(pipe, "cpu", torch.float32, cache_dir).precompute([a, missing], info)
    out["failure_error"] = None
except SageGRPOError as e:
    out["failure_error"] = str(e)
(out_dir / f"rank{info.rank}.json").write_text(json.dumps(out))
barrier()  # every rank done before any closes its connections (gloo aborts a peer still using them)
destroy()
