"""The JSON report every benchmark script writes (scripts/bench_step.py, scripts/bench_reward.py).

    {"benchmark": name, "command": the command line, "time": ISO time, "host": {device, gpu, cpu_count, torch,
     diffusers, measured_on_gpu}, "ratios": {headline ratios}, "results": {everything else}, "notes": [...]}

Speed lives in these reports (medians and ratios within one run), never in timed tests.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

__all__ = ["default_json_path", "host_info", "write_report"]


def default_json_path(name: str) -> Path:
    """$OUT/<name>.json when OUT is set (the GPU machine's returned folder), else outputs/bench/<name>.json."""
    base = os.environ.get("OUT") or "outputs/bench"
    return Path(base) / f"{name}.json"


def host_info(device) -> dict:
    import torch

    try:
        import diffusers

        dv = diffusers.__version__
    except ImportError:  # pragma: no cover
        dv = None
    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    return {"device": str(dev), "gpu": gpu, "measured_on_gpu": gpu is not None, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "diffusers": dv, "python": sys.version.split()[0]}


def _clean(x):
    """NaN/inf -> None (valid JSON), tuples -> lists, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_report(
    path: str | Path, name: str, device, ratios: dict, results: dict, notes: list[str] | None = None
) -> Path:
    report = {
        "benchmark": name,
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": host_info(device),
        "ratios": ratios,
        "results": results,
        "notes": list(notes or []),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(report), indent=1) + "\n")
    return path
