"""download_weights.sh for real, through a server that speaks the Hugging Face hub's protocol: olah (PyPI, a
self-hosted hub mirror) in its offline mode, on loopback, serving local git repositories (their weights in git-lfs)
that hold the tiny checkpoints under the repository names the script downloads. Then, from what landed in ckpts/ and
with the README's defaults (no path flags; tiny sizes only), one step of post_train.py, generate.py and
scripts/score_videos.py. This is not the real hub: the repositories hold tiny random weights, and their other files
(the decoys: other versions, other precisions and formats) are our guess at what the real ones hold beside.

- What the script asks for is what the loaders read: every file of a repository's tiny checkpoint must land (a
  loader needs it, as the runs show) with the served bytes; no decoy may land.
- A download stopped midway (the server killed) ends in the script's line (after hf's own report of the lost
  connection, a traceback: hf's output is not filtered, it carries the progress bars) and completes on the next
  call, byte for byte.
- A repository that answers 401 or 403 ends in one line naming `hf auth login`: olah's mirrors know no gated
  repositories, so a small gate in front of it answers for black-forest-labs/FLUX.1-Redux-dev's files as the hub
  does for a gated repository (401 without a token, 403 with one, X-Error-Code GatedRepo) and passes everything
  else to olah. An unknown repository, and a version the authors' repository does not hold, are one line each.
- Glyph-SDXL-v2 comes from ModelScope, which no server here speaks: the test puts it where the script's note says.
  The tiny checkpoints' text lengths (sage_grpo_text_lengths.json, no real repository has one) travel in the
  diffusers repositories and are put into the authors' root by hand.

Full tier (slow): ~3 minutes on one core. Needs git-lfs (Debian: apt-get install git-lfs) and olah (the dev extra).
"""

from __future__ import annotations

import contextlib
import csv
import fnmatch
import http.client
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import TINY_MIN_PIXELS, free_port, load_script, smooth_image

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "download_weights.sh"
HF = Path(sys.executable).parent / "hf"
GATED = "black-forest-labs/FLUX.1-Redux-dev"
LFS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack")  # the hub's default .gitattributes (part)
PROMPTS = "prompt\na red fox trots through fresh snow at dawn, soft light\nwaves break on a rocky shore\n"


def _missing() -> str:
    import importlib.util

    if shutil.which("bash") is None or shutil.which("git") is None:
        return "needs bash and git"
    if subprocess.run(["git", "lfs", "version"], capture_output=True).returncode != 0:
        return "needs git-lfs (apt-get install git-lfs)"
    if importlib.util.find_spec("olah") is None:
        return "needs olah (pip install olah; in the dev extra)"
    if not HF.is_file():
        return f"needs the hf CLI next to {sys.executable}"
    if shutil.which("modelscope", path="/usr/bin:/bin"):
        return "a system-wide modelscope would download Glyph-SDXL-v2 from the network"
    return ""


_WHY_NOT = _missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT or "-")]


def _tree(d: Path, under: str = "", to: str = "") -> dict[str, Path]:
    """{path below d/under, prefixed by `to`: file} of every file under d/under."""
    base = d / under if under else d
    return {to + p.relative_to(base).as_posix(): p for p in sorted(base.rglob("*")) if p.is_file()}


def _blob(n: int = 4096) -> bytes:
    return os.urandom(n)


class Repo:
    """A served repository: `files` (what the loaders read: must land, byte for byte, in `dest` below ckpts/) and
    `decoys` (files beside them no loader reads: must not land)."""

    def __init__(self, name: str, dest: str, files: dict[str, Path], decoys: dict[str, bytes] | None = None):
        self.name, self.dest, self.files, self.decoys = name, dest, files, decoys or {}

    def write(self, mirrors: Path, env: dict) -> None:
        """A git repository at mirrors/models/<org>/<name> (where olah looks), the weights in git-lfs."""
        path = mirrors / "models" / self.name
        path.mkdir(parents=True)

        def git(*args):
            subprocess.run(["git", *args], cwd=path, check=True, capture_output=True, env=env, timeout=120)

        git("init", "-q", "-b", "main")
        git("lfs", "install", "--local")
        (path / ".gitattributes").write_text("".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS))
        for rel, src in {**self.files, **self.decoys}.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_bytes(src if isinstance(src, bytes) else src.read_bytes())
        git("add", "-A")
        git("commit", "-q", "-m", "tiny checkpoint")
        pointer = subprocess.run(["git", "lfs", "ls-files", "-n"], cwd=path, capture_output=True, text=True,
                                 env=env, check=True).stdout.split()
        assert sorted(pointer) == sorted(f for f in {**self.files, **self.decoys}
                                         if any(fnmatch.fnmatch(Path(f).name, p) for p in LFS)), self.name

    def check_landed(self, ck: Path, exact: bool = True) -> None:
        """Every file landed with the served bytes, no decoy did; `exact`: nothing else is in dest (hf's .cache/
        and the repository's .gitattributes aside)."""
        dest = ck / self.dest
        for rel, src in self.files.items():
            assert (dest / rel).is_file(), f"{self.name}: {rel} did not land in {dest}"
            assert (dest / rel).read_bytes() == src.read_bytes(), f"{self.name}: {rel} differs from the served file"
        landed_decoys = [rel for rel in self.decoys if (dest / rel).exists()]
        assert not landed_decoys, f"{self.name}: files no loader reads were downloaded: {landed_decoys}"
        if exact:
            landed = {p.relative_to(dest).as_posix() for p in dest.rglob("*")
                      if p.is_file() and ".cache" not in p.relative_to(dest).parts}
            assert landed - {".gitattributes"} == set(self.files), (self.name, landed ^ set(self.files))


class Hub:
    """olah (offline, mirrors only) on 127.0.0.1:<port>; start() and stop() (SIGKILL: a server that dies midway)."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        (root / "olah.toml").write_text(
            f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\nrepos-path = "{root / "cache"}"\n'
            f'mirrors-path = ["{root / "mirrors"}"]\n[accessibility]\noffline = true\n')

    def start(self) -> None:
        log = open(self.root / "olah.out", "ab")  # noqa: SIM115 - the server's output, for a failure's message
        self.proc = subprocess.Popen([sys.executable, "-m", "olah.server", "-c", str(self.root / "olah.toml")],
                                     cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, (self.root / "olah.out").read_text()[-3000:]
            with contextlib.suppress(OSError):
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/api/models/tencent/HunyuanVideo-1.5/revision/main")
                if c.getresponse().status == 200:
                    return
            assert time.monotonic() < deadline, "olah did not answer within 90 s"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _Gate(BaseHTTPRequestHandler):
    """Passes every request to olah, except those for a file of GATED: 401 (no token) or 403 (a token), as the hub
    answers for a gated repository whose terms the account has not accepted."""

    upstream_port = 0

    def _answer(self):
        if self.path.startswith(f"/{GATED}/resolve/"):
            code = 403 if self.headers.get("Authorization") else 401
            msg = f"Access to model {GATED} is restricted. You must have access to it and be authenticated."
            body = json.dumps({"error": msg}).encode()
            self.send_response(code)
            for k, v in (("X-Error-Code", "GatedRepo"), ("X-Error-Message", msg), ("Content-Type", "application/json"),
                         ("Content-Length", str(len(body)))):
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        c = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
        c.request(self.command, self.path, headers={k: v for k, v in self.headers.items()
                                                    if k.lower() not in ("host", "connection")})
        r = c.getresponse()
        body = r.read()
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", r.getheader("Content-Length", "0") if self.command == "HEAD"
                         else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def gate(hub: Hub):
    """The gate in front of `hub`, in a thread -> its URL (an HF_ENDPOINT)."""
    handler = type("Gate", (_Gate,), {"upstream_port": hub.port})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_diffusers_dir, tiny_i2v_dir, tiny_authors_dir, tiny_dirs, tiny_clip_dirs):
    """olah serving the repositories download_weights.sh names, holding the tiny checkpoints -> (Hub, {name: Repo},
    {"authors_root": the tiny authors' t2v checkpoint (its Glyph-SDXL-v2 and text lengths), "bin": a PATH folder
    with hf alone}."""
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("hub")
    authors_i2v = write_tiny_checkpoint(root / "authors_i2v", "authors", seed=0, version="480p_i2v")
    authors = Path(tiny_authors_dir)
    clip, pick, laion = (Path(tiny_clip_dirs[k]) for k in ("clip", "pick_model", "pick_processor"))
    readme = b"---\nlicense: other\n---\n# a tiny stand-in\n"
    other_formats = {"pytorch_model.bin": _blob(), "tf_model.h5": _blob(), "flax_model.msgpack": _blob()}
    repos = [
        Repo("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v", "HunyuanVideo-1.5-Diffusers-480p_t2v",
             _tree(Path(tiny_diffusers_dir))),
        Repo("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v", "HunyuanVideo-1.5-Diffusers-480p_i2v",
             _tree(Path(tiny_i2v_dir))),
        # the authors' repository: every version's transformer, the SR upsamplers, their scheduler config, ...
        Repo("tencent/HunyuanVideo-1.5", ".",
             {**_tree(authors, "transformer/480p_t2v", "transformer/480p_t2v/"), **_tree(authors, "vae", "vae/"),
              **_tree(authors_i2v, "transformer/480p_i2v", "transformer/480p_i2v/")},
             {"transformer/720p_t2v/config.json": b'{"rope_dim_list": [4, 6, 6]}',
              "transformer/720p_t2v/diffusion_pytorch_model.safetensors": _blob(),
              "upsampler/720p_sr_distilled/config.json": b"{}",
              "upsampler/720p_sr_distilled/diffusion_pytorch_model.safetensors": _blob(),
              "scheduler/scheduler_config.json": b'{"_class_name": "FlowMatchDiscreteScheduler", "shift": 7.0}',
              "config.json": b"{}", "README.md": readme}),
        Repo("Qwen/Qwen2.5-VL-7B-Instruct", "text_encoder/llm", _tree(authors, "text_encoder/llm")),
        Repo("google/byt5-small", "text_encoder/byt5-small", _tree(authors, "text_encoder/byt5-small"),
             {**other_formats, "README.md": readme}),
        Repo(GATED, "vision_encoder/siglip", _tree(authors_i2v, "vision_encoder/siglip"),
             {"flux1-redux-dev.safetensors": _blob(), "image_embedder/config.json": b"{}",
              "image_embedder/diffusion_pytorch_model.safetensors": _blob(), "model_index.json": b"{}",
              "README.md": readme}),
        Repo("KlingTeam/VideoReward", "VideoReward", _tree(Path(tiny_dirs["old"]))),
        Repo("Qwen/Qwen2-VL-2B-Instruct", "Qwen2-VL-2B-Instruct", _tree(Path(tiny_dirs["base"]))),
        Repo("openai/clip-vit-large-patch14", "clip-vit-large-patch14", _tree(clip),
             {**other_formats, "README.md": readme}),
        Repo("yuvalkirstain/PickScore_v1", "PickScore_v1", _tree(pick), {"pytorch_model.bin": _blob()}),
        # PickScore's processor: its tokenizer and preprocessor files; the model's weights are read from PickScore_v1
        Repo("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "CLIP-ViT-H-14-laion2B-s32B-b79K",
             {k: v for k, v in _tree(laion).items() if k != "model.safetensors"},
             {"model.safetensors": (laion / "model.safetensors").read_bytes(), "open_clip_pytorch_model.bin": _blob(),
              "open_clip_model.safetensors": _blob(), "pytorch_model.bin": _blob()}),
    ]
    git_env = {**os.environ, "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t",
               "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for r in repos:
        r.write(root / "mirrors", git_env)
    (root / "bin").mkdir()
    (root / "bin" / "hf").symlink_to(HF)  # PATH: hf, and no modelscope
    h = Hub(root)
    h.start()
    try:
        yield h, {r.name: r for r in repos}, {"authors_root": authors, "bin": root / "bin", "hf_home": root / "hf"}
    finally:
        h.stop()


def download(hub_, work: Path, *args: str, endpoint: str = "", popen: bool = False, **env):
    """./download_weights.sh ARGS in `work` (ckpts/ there), HF_ENDPOINT = the hub (or `endpoint`), an empty HF_HOME
    (no token unless HF_TOKEN is in `env`) -> CompletedProcess (a Popen with `popen`)."""
    h, _, extra = hub_
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(HF_ENDPOINT=endpoint or h.url, HF_HOME=str(extra["hf_home"]), HF_HUB_DISABLE_TELEMETRY="1",
             HF_HUB_DISABLE_UPDATE_CHECK="1", PATH=f"{extra['bin']}:/usr/bin:/bin", **env)
    cmd = ["bash", str(SCRIPT), *args]
    if popen:
        return subprocess.Popen(cmd, cwd=work, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=work, env=e, capture_output=True, text=True, timeout=600)


def ok(r) -> str:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    return r.stdout


def one_line(r) -> str:
    """The error a failed call ended with: exit 1, no traceback, the last line of stderr -> that line."""
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), r.stderr[-3000:]
    return last


def _landed_files(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and ".cache" not in p.parts}


def _tiny_sizes(*extra: str) -> list[str]:
    return ["--video_length", "5", "--num_inference_steps", "2", "--dtype", "fp32", *extra]


def test_diffusers_layout_and_metrics_download_resume_then_train_generate_score(hub, tmp_path, monkeypatch):
    """The README's quick start: ./download_weights.sh (stopped midway by a dying server, then again: complete),
    `metrics`, VERSION=480p_i2v; one GRPO step with the one-GPU LoRA command (no --model_path: the defaults find
    ckpts/HunyuanVideo-1.5-Diffusers-480p_t2v and ckpts/VideoReward), generate.py from its checkpoint, score_videos
    with VideoAlign, CLIPScore and PickScore; an image-to-video video from the 480p_i2v download; an unknown
    repository and an endpoint that does not answer are one line each."""
    from post_train_helpers import pt

    import generate

    h, repos, _ = hub
    work = tmp_path / "w"
    work.mkdir()
    ck = work / "ckpts"
    t2v = repos["hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"]

    # the server dies once the first file of the transformer repository has landed
    proc = download(hub, work, popen=True)
    deadline = time.monotonic() + 300
    while not ((ck / t2v.dest).is_dir() and _landed_files(ck / t2v.dest)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    h.stop()
    out, err = proc.communicate(timeout=600)
    stopped = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    h.start()
    missing = set(t2v.files) - _landed_files(ck / t2v.dest)
    assert missing, "the download finished before the server stopped: nothing was interrupted"
    # hf's own report of the lost connection (a traceback) comes first; the script's line ends it
    line = stopped.stderr.strip().splitlines()[-1]
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert line.startswith(f"error: the download of {t2v.name} into ckpts/{t2v.dest} stopped before the end")
    assert "run the same command again" in line
    assert "done" not in out and not (ck / "VideoReward").exists()

    assert "done: weights under ckpts" in ok(download(hub, work))  # the next call completes it
    ok(download(hub, work, "metrics"))
    ok(download(hub, work, VERSION="480p_i2v"))  # the I2V checkpoint; the reward is already there
    for name in (t2v.name, "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v", "KlingTeam/VideoReward",
                 "Qwen/Qwen2-VL-2B-Instruct", "openai/clip-vit-large-patch14", "yuvalkirstain/PickScore_v1",
                 "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
        repos[name].check_landed(ck)
    assert sorted(p.name for p in ck.iterdir()) == sorted(
        [t2v.dest, "HunyuanVideo-1.5-Diffusers-480p_i2v", "VideoReward", "Qwen2-VL-2B-Instruct",
         "clip-vit-large-patch14", "PickScore_v1", "CLIP-ViT-H-14-laion2B-s32B-b79K"])

    # a version whose repository the hub does not hold: one line, nothing downloaded
    line = one_line(download(hub, work, VERSION="720p_t2v"))
    assert line.startswith(f"error: no repository {t2v.name.replace('480p', '720p')} at {h.url} (check the name")
    nothing = ck / "HunyuanVideo-1.5-Diffusers-720p_t2v"
    assert not nothing.exists() or not _landed_files(nothing)
    down = f"http://127.0.0.1:{free_port()}"  # no server there
    assert one_line(download(hub, work, "reward", endpoint=down)).startswith(f"error: {down} does not answer")

    # the README's commands, from ckpts/ and their defaults; tiny sizes only
    monkeypatch.chdir(work)
    (work / "prompts.csv").write_text(PROMPTS)
    pt.main(["--train_video_csv", "prompts.csv", "--use_lora", "True", "--master_weight_type", "bf16",
             "--enable_fsdp", "False", "--batch_size", "2", "--num_generations", "2", "--output_dir", "outputs/lora",
             "--max_steps", "1", "--grpo_sampling_steps", "2", "--sample_n_frames", "5", "--height", "32",
             "--width", "32", "--validation_interval", "0", "--report_to", "none", "--reward_min_pixels",
             str(TINY_MIN_PIXELS)])
    [row] = [json.loads(x) for x in (work / "outputs/lora/metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and math.isfinite(row["reward/Overall_mean"]), row
    videos = generate.main(["--checkpoint_path", "outputs/lora/checkpoint-1", "--valid_video_csv", "prompts.csv",
                            "--output_path", "outputs/gen", *_tiny_sizes("--fixed_size", "32x32")])
    assert len(videos) == 2 and all(Path(v).is_file() for v in videos)
    sv = load_script("score_videos")
    assert sv.main(["--videos", "outputs/gen", "--out", "eval/step1", "--metrics",
                    "videoalign_local,clipscore,pickscore", "--device", "cpu", "--min_pixels",
                    str(TINY_MIN_PIXELS)]) == 0
    table = list(csv.DictReader((work / "eval/step1.csv").open(encoding="utf-8")))
    assert len(table) == 3 and all(math.isfinite(float(r[c])) for r in table for c in
                                   ("VQ", "MQ", "TA", "Overall", "CLIPScore", "PickScore"))

    # image-to-video from the 480p_i2v download (the version flag names the folder)
    image = smooth_image(work / "first.png", 32, 32, 1)
    [i2v] = generate.main(["--pretrained_transformer_version", "480p_i2v", "--prompt", "a red ball rolls",
                           "--image", image, "--output_path", "outputs/gen_i2v", *_tiny_sizes()])
    assert Path(i2v).is_file()


def test_authors_layout_download_gated_and_missing_version_then_generate(hub, tmp_path, monkeypatch):
    """./download_weights.sh authors: only transformer/480p_t2v and vae/ of the authors' repository (no other
    version, upsampler or scheduler), byt5-small's config and tokenizer files only; Glyph-SDXL-v2 is a note (put
    by hand where it names); generate.py then samples with the defaults (the authors' layout at ckpts/).
    VERSION=480p_i2v: the gated FLUX.1-Redux-dev answers 401, then 403 with a token: one line naming `hf auth
    login` each; once it lets us in, its SigLIP lands (not its other files) and an I2V video is generated. A version
    the authors' repository does not hold is one line."""
    import generate

    h, repos, extra = hub
    work = tmp_path / "w"
    work.mkdir()
    ck = work / "ckpts"
    tencent = repos["tencent/HunyuanVideo-1.5"]

    r = download(hub, work, "authors")
    line = one_line(r)  # everything else landed; without modelscope the end says what is missing
    assert "not fetched: Glyph-SDXL-v2" in line and "modelscope" in line
    glyph = ck / "text_encoder" / "Glyph-SDXL-v2"
    assert f"fetch Glyph-SDXL-v2 by hand into {glyph.relative_to(work)}" in r.stderr
    for name in ("Qwen/Qwen2.5-VL-7B-Instruct", "google/byt5-small", "KlingTeam/VideoReward",
                 "Qwen/Qwen2-VL-2B-Instruct"):
        repos[name].check_landed(ck)
    i2v_files = {k for k in tencent.files if k.startswith("transformer/480p_i2v/")}
    t2v_only = Repo(tencent.name, ".", {k: v for k, v in tencent.files.items() if k not in i2v_files},
                    {**tencent.decoys, **dict.fromkeys(i2v_files, b"")})
    t2v_only.check_landed(ck, exact=False)
    assert sorted(p.name for p in ck.iterdir() if p.name != ".cache") == [
        "Qwen2-VL-2B-Instruct", "VideoReward", "text_encoder", "transformer", "vae"]
    # what ModelScope would deliver, and the tiny model's text lengths (no real repository holds them)
    shutil.copytree(extra["authors_root"] / "text_encoder" / "Glyph-SDXL-v2", glyph)
    shutil.copy(extra["authors_root"] / "sage_grpo_text_lengths.json", ck)

    monkeypatch.chdir(work)
    [t2v] = generate.main(["--prompt", "a red fox", "--output_path", "outputs/gen", *_tiny_sizes("--fixed_size",
                                                                                                 "32x32")])
    assert Path(t2v).is_file()

    # the gated SigLIP: 401 without a token, 403 with one; one line naming `hf auth login` each
    with gate(h) as url:
        for env, code in (({}, "401"), ({"HF_TOKEN": "hf_not_accepted"}, "403")):
            line = one_line(download(hub, work, "authors", endpoint=url, VERSION="480p_i2v", **env))
            assert line.startswith(f"error: {GATED} refused access (HTTP {code}") and "`hf auth login`" in line
            assert f"{url}/{GATED}" in line
    assert not (ck / "vision_encoder" / "siglip").exists() or not _landed_files(ck / "vision_encoder" / "siglip")
    ok(download(hub, work, "authors", VERSION="480p_i2v"))  # access granted
    repos[GATED].check_landed(ck)
    tencent.check_landed(ck, exact=False)
    [i2v] = generate.main(["--pretrained_transformer_version", "480p_i2v", "--prompt", "a red ball rolls", "--image",
                           smooth_image(work / "first.png", 32, 32, 1), "--output_path", "outputs/gen_i2v",
                           *_tiny_sizes()])
    assert Path(i2v).is_file()

    # a version the authors' repository does not hold (yet): one line naming the pattern
    line = one_line(download(hub, work, "authors", VERSION="720p_t2v_distilled"))
    assert line == (f"error: {tencent.name} at {h.url} has no file matching 'transformer/720p_t2v_distilled/*': "
                    "VERSION=720p_t2v_distilled is not published there (yet)")
