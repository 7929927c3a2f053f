"""Plain helpers shared by test modules (import them explicitly: `from helpers import ...`); the fixtures are in
tests/conftest.py."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from diffusers import HunyuanVideo15Transformer3DModel

from sage_grpo.models.tiny import tiny_transformer_config

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str, register: bool = False):
    """A script of the repository (e.g. "scripts/bench_step.py", or a bare name under scripts/: "score_videos") as a
    module, to call its functions and main(); `register`: also as sys.modules[<its name>], where dataclasses
    defined in it look their module up."""
    path = ROOT / relpath if relpath.endswith(".py") else ROOT / "scripts" / f"{relpath}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc, url: str, timeout: float, output) -> None:
    """Poll `url`/health until it answers 200; a server process `proc` that exits first, or no answer within
    `timeout` seconds, raises with `output()` (its log)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {output()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start within {timeout} s")
        time.sleep(0.1)


@contextlib.contextmanager
def serve(*flags: str, token: str = "", port: int | None = None, env: dict | None = None):
    """scripts/serve_reward.py in its own process (SAGE_REWARD_TOKEN=`token`, unset when "") -> (url, process);
    killed (by its pid) on exit."""
    port = port or free_port()
    e = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    e.pop("SAGE_REWARD_TOKEN", None)
    if token:
        e["SAGE_REWARD_TOKEN"] = token
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/serve_reward.py"), "--port", str(port),
                             "--device", "cpu", *flags], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, 60, proc.stdout.read)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


TINY_FRAMES, TINY_H, TINY_W = 9, 32, 48  # -> latent [4, 3, 8, 12]: 288 video tokens
TINY_MIN_PIXELS = 28 * 28 * 4  # keeps tiny frames tiny (the real default would upscale 32x48 to ~100k pixels)


def smooth_videos(b: int = 3, f: int = 9, h: int = 32, w: int = 48, seed: int = 0) -> torch.Tensor:
    """Deterministic smooth, moving colour gradients float [B, F, 3, H, W] in [0, 1] (codec-friendly)."""
    g = torch.Generator().manual_seed(seed)
    phase = torch.rand(b, 3, generator=g) * 2 * math.pi  # [B, 3]
    freq = 1.0 + torch.rand(b, 3, generator=g) * 2.0  # [B, 3]
    t = torch.arange(f).float().view(1, f, 1, 1, 1) / max(f - 1, 1)
    y = torch.linspace(0, 1, h).view(1, 1, 1, h, 1)
    x = torch.linspace(0, 1, w).view(1, 1, 1, 1, w)
    arg = freq.view(b, 1, 3, 1, 1) * (x + 0.5 * y + 0.6 * t) * math.pi + phase.view(b, 1, 3, 1, 1)
    return 0.5 + 0.4 * torch.sin(arg)  # [B, F, 3, H, W]


def sigterm_in_step(backward, step: int):
    """post_train's `backward_phase` wrapped to send this process SIGTERM in the backward pass while `state.step` is
    `step` (inside the accumulation round of step `step` + 1), as a stop arriving mid-update would."""
    import signal

    def phase(c, state, *a, **k):
        if state.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return backward(c, state, *a, **k)

    return phase


def signal_after_steps(cmd: list[str], metrics: Path, steps: int, sig: int, **popen) -> tuple[int, str]:
    """Start `cmd`, send `sig` once `metrics` (a run's metrics.jsonl) has `steps` rows, wait -> (exit code, output)."""
    import subprocess
    import time

    from sage_grpo.metrics import read_metrics

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    try:
        deadline = time.time() + 300
        while not metrics.exists() or len(read_metrics(metrics)) < steps:
            assert proc.poll() is None and time.time() < deadline, f"the run ended or stalled before step {steps}"
            time.sleep(0.2)
        proc.send_signal(sig)
        log = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, log


# Valid-token attention fixtures (test_attention, test_compile)
TXT, B5, IMG = 24, 8, 4  # MLLM, ByT5 and image token slots (the real model: 1000, 256, 729)


def perturbed_transformer(dtype=torch.float64, layers=2, seed=0):
    torch.manual_seed(seed)
    m = HunyuanVideo15Transformer3DModel(**{**tiny_transformer_config(), "num_layers": layers})
    with torch.no_grad():  # some layers start at zero (proj_out): perturb all so every weight matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.to(dtype)


def attention_inputs(dtype, txt_valid=(17, 3), b5_valid=(5, 1), image=False, seed=1):
    """A CFG-like batch: prompts with different valid MLLM and ByT5 lengths (right padding, as the encoders give)."""
    g = torch.Generator().manual_seed(seed)
    b = len(txt_valid)
    cfg = tiny_transformer_config()

    def mask(n, valid):
        return torch.stack([torch.arange(n) < v for v in valid]).long()

    return dict(
        hidden_states=torch.randn(b, cfg["in_channels"], 3, 4, 6, generator=g).to(dtype),  # 72 video tokens
        timestep=torch.tensor([700.0, 300.0, 500.0][:b]).to(dtype),
        encoder_hidden_states=torch.randn(b, TXT, cfg["text_embed_dim"], generator=g).to(dtype),
        encoder_attention_mask=mask(TXT, txt_valid),
        encoder_hidden_states_2=torch.randn(b, B5, cfg["text_embed_2_dim"], generator=g).to(dtype),
        encoder_attention_mask_2=mask(B5, b5_valid),
        image_embeds=torch.randn(b, IMG, cfg["image_embed_dim"], generator=g).to(dtype) * float(image),
        return_dict=False,
    )


def max_rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def smooth_image(path, h, w, seed):
    """A smooth random RGB picture h x w saved at `path` (PNG) -> path."""
    import numpy as np
    import PIL.Image

    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 4, 4, generator=g)
    img = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]
    PIL.Image.fromarray((img.permute(1, 2, 0).numpy() * 255).astype(np.uint8)).save(path)
    return str(path)


def i2v_prompts(folder, n=4):
    """A prompt CSV with a different 16:9-ish image per prompt (one bucket), paths relative to the file."""
    (folder / "imgs").mkdir(parents=True, exist_ok=True)
    rows = ["prompt,ref_image_path"]
    for i in range(n):
        smooth_image(folder / "imgs" / f"{i}.png", 36 + i, 64 + 2 * i, 10 + i)
        rows.append(f"a scene number {i},imgs/{i}.png")
    (folder / "prompts.csv").write_text("\n".join(rows) + "\n")
    return folder / "prompts.csv"


def lora_checkpoint(folder: Path, base: Path | None, task: str = "t2v", transformer=None, **settings) -> Path:
    """`folder`/checkpoint-1 of a LoRA run as post_train.py writes it: train_state.json (the run's config, its
    model_path `base`, and task) and lora/ a random adapter (r 2, alpha 2, seed 3) on every linear of the blocks of
    `base`'s transformer (or of `transformer`, a model of another shape). settings: config keys of the run."""
    import json

    from sage_grpo.config import config_from_dict, config_to_dict
    from sage_grpo.models.lora import adapter_parameters, save_lora, setup_trainable

    tr = transformer if transformer is not None else HunyuanVideo15Transformer3DModel.from_pretrained(
        base / "transformer")
    setup_trainable(tr, use_lora=True, lora_r=2, lora_alpha=2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in adapter_parameters(tr).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ckpt = folder / "checkpoint-1"
    save_lora(tr, ckpt / "lora")
    model = {"model_path": str(base)} if base is not None else {}
    cfg = config_from_dict({**model, "use_lora": True, "lora_r": 2, "lora_alpha": 2, **settings})
    (ckpt / "train_state.json").write_text(json.dumps({"step": 1, "config": config_to_dict(cfg), "task": task}))
    return ckpt
