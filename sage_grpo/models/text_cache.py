"""Text conditioning: encode each distinct prompt once, keep it in memory (and optionally on disk).

The authors encode every prompt twice per rollout and keep the 7B text encoder on every GPU (their defect 12).
Here `TextEmbeddingCache.get(prompts)` runs diffusers' `encode_prompt` (chat template, crop, glyph extraction for
quoted text) once per distinct string, stores the four tensors on CPU, and `offload_encoders()` moves the text
encoders off the accelerator once the prompt set is cached; an uncached prompt later still works (the encoders
come back for it). The disk cache is keyed by sha256(prompt + encoder identity), one safetensors file per prompt.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from sage_grpo.errors import SageGRPOError

__all__ = ["TextConditioning", "TextEmbeddingCache", "encoder_identity"]


@dataclass
class TextConditioning:
    """Conditioning of N prompts, as HunyuanVideo15Transformer3DModel.forward takes it."""

    prompt_embeds: Tensor  # [N, L, D_text] MLLM hidden_states[-3], system prompt cropped
    prompt_mask: Tensor  # [N, L] 1 = valid token (right padding)
    byt5_embeds: Tensor  # [N, L2, D_byt5] glyph embeddings (zeros when the prompt quotes no text)
    byt5_mask: Tensor  # [N, L2]

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def _map(self, fn) -> TextConditioning:
        fields = (self.prompt_embeds, self.prompt_mask, self.byt5_embeds, self.byt5_mask)
        return TextConditioning(*(fn(t) for t in fields))

    def to(self, device=None, dtype: torch.dtype | None = None) -> TextConditioning:
        """Move; `dtype` casts embeddings and masks alike (the pipeline hands masks in the transformer dtype)."""
        return self._map(lambda t: t.to(device=device, dtype=dtype))

    def index(self, idx: Tensor | list[int] | slice) -> TextConditioning:
        return self._map(lambda t: t[idx])

    @staticmethod
    def cat(items: list[TextConditioning]) -> TextConditioning:
        return TextConditioning(*(torch.cat(ts, dim=0) for ts in zip(*(_fields(c) for c in items))))


def _fields(c: TextConditioning) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return c.prompt_embeds, c.prompt_mask, c.byt5_embeds, c.byt5_mask


_TEXT_DIRS = {  # what the prompt embeddings depend on, per checkpoint layout
    "diffusers": ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"),
    "authors": ("text_encoder",),  # llm/, byt5-small/, Glyph-SDXL-v2/
}
_SMALL_FILE = 1 << 20  # configs and tokenizer files are hashed whole; larger (weight) files by head and tail


def _file_digest(path: Path) -> str:
    """Content digest that is cheap for multi-GB weight files: size + first and last MiB (fine-tuned weights change
    both); small files whole, with config.json's `_name_or_path` (the path it was loaded from) left out."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= _SMALL_FILE:
            data = f.read()
            if path.name == "config.json":
                try:
                    cfg = json.loads(data)
                    cfg.pop("_name_or_path", None)
                    data = json.dumps(cfg, sort_keys=True).encode()
                except ValueError:
                    pass
            h.update(data)
        else:
            h.update(f.read(_SMALL_FILE))
            f.seek(-_SMALL_FILE, 2)
            h.update(f.read(_SMALL_FILE))
    return h.hexdigest()


def encoder_identity(pipe) -> str:
    """What the embeddings depend on besides the prompt: the text encoder and tokenizer files (read from disk, so the
    identity is the same whether or not the encoders are loaded, and wherever the directory lives), the text lengths
    and the system message. Different weights at the same path get a different identity."""
    loc = getattr(pipe, "sage_grpo_location", None)
    if loc is None:
        raise ValueError("the text-embedding cache needs a pipeline from sage_grpo.models.loading.load_pipeline")
    parts = [loc.layout]
    for sub in _TEXT_DIRS[loc.layout]:
        d = Path(loc.root) / sub
        files = sorted(f for f in d.rglob("*") if f.is_file()) if d.is_dir() else []
        parts += [f"{f.relative_to(loc.root).as_posix()}:{_file_digest(f)}" for f in files]
    lengths = {k: getattr(pipe, k)
               for k in ("tokenizer_max_length", "prompt_template_encode_start_idx", "tokenizer_2_max_length")}
    parts += [json.dumps(lengths, sort_keys=True), getattr(pipe, "system_message", "")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def truncated_lengths(pipe, prompt: str) -> list[tuple[str, int, int]]:
    """[(encoder, tokens of the prompt, limit)] for each text encoder whose limit the prompt exceeds. diffusers'
    `encode_prompt` truncates silently: the MLLM at `tokenizer_max_length` tokens after the system-prompt crop, the
    glyph (ByT5) encoder at `tokenizer_2_max_length` bytes of the quoted text."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts, format_text_input

    out = []
    ids = pipe.tokenizer.apply_chat_template(format_text_input([prompt], pipe.system_message),
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    n = len(ids[0]) - pipe.prompt_template_encode_start_idx  # tokens after the crop of the system prompt
    if n > pipe.tokenizer_max_length:
        out.append(("text encoder", n, pipe.tokenizer_max_length))
    glyph = extract_glyph_texts(prompt)
    if glyph is not None:
        m = len(pipe.tokenizer_2(glyph, add_special_tokens=True)["input_ids"])
        if m > pipe.tokenizer_2_max_length:
            out.append(("glyph (ByT5) encoder", m, pipe.tokenizer_2_max_length))
    return out


def warn_if_truncated(pipe, prompt: str) -> None:
    for name, n, limit in truncated_lengths(pipe, prompt):
        warnings.warn(f"prompt {prompt[:60]!r}... has {n} tokens for the {name}, whose limit is {limit}: the rest is "
                      "cut off (shorten the prompt to keep all of it)", stacklevel=3)


class TextEmbeddingCache:
    """prompt -> TextConditioning [1, ...] on CPU in `dtype`; `get` batches them.

    pipe: a HunyuanVideo15Pipeline (its encoders may be None if every prompt is on disk).
    device: where the text encoders run. cache_dir: optional on-disk cache ("" / None = memory only).
    """

    def __init__(self, pipe, device: torch.device | str, dtype: torch.dtype, cache_dir: str | Path | None = None):
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._memory: dict[str, TextConditioning] = {}
        self._identity: str | None = None
        self._offloaded = False
        self.num_encoded = 0  # prompts run through the encoders (tests and logs)

    @property
    def identity(self) -> str:
        if self._identity is None:
            self._identity = encoder_identity(self.pipe) + f":{self.dtype}"
        return self._identity

    def _path(self, prompt: str) -> Path:
        key = hashlib.sha256(f"{self.identity}\n{prompt}".encode()).hexdigest()
        return self.cache_dir / f"{key}.safetensors"

    def _load_disk(self, prompt: str) -> TextConditioning | None:
        if self.cache_dir is None:
            return None
        path = self._path(prompt)
        if not path.is_file():
            return None
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        if meta.get("prompt") != prompt or meta.get("identity") != self.identity:
            return None
        t = load_file(path)
        return TextConditioning(t["prompt_embeds"], t["prompt_mask"], t["byt5_embeds"], t["byt5_mask"])

    def _save_disk(self, prompt: str, c: TextConditioning) -> None:
        if self.cache_dir is None:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self._path(prompt)
        tmp = path.with_suffix(".tmp")
        names = ("prompt_embeds", "prompt_mask", "byt5_embeds", "byt5_mask")
        tensors = dict(zip(names, (t.contiguous() for t in _fields(c))))
        save_file(tensors, tmp, metadata={"prompt": prompt, "identity": self.identity})
        tmp.replace(path)  # atomic: concurrent ranks never read half a file

    @torch.no_grad()
    def _encode(self, prompt: str) -> TextConditioning:
        pipe = self.pipe
        if pipe.text_encoder is None or pipe.text_encoder_2 is None:
            raise SageGRPOError(
                f"prompt {prompt!r} is not in the text-embedding cache and the text encoders were not loaded; "
                "load them (load_text_encoders=True) to encode it"
            )
        if self._offloaded:
            pipe.text_encoder.to(self.device)
            pipe.text_encoder_2.to(self.device)
        try:
            # batch of 1: padded to the fixed lengths anyway, and identical to what the pipeline computes.
            pe, pm, be, bm = pipe.encode_prompt(prompt=[prompt], device=self.device, dtype=self.dtype, batch_size=1)
        finally:
            if self._offloaded:
                self._move_encoders("cpu")
        self.num_encoded += 1
        warn_if_truncated(pipe, prompt)
        return TextConditioning(pe, pm, be, bm).to("cpu")

    def lookup(self, prompt: str) -> TextConditioning:
        """One prompt -> [1, ...] on CPU (memory, then disk, then the encoders)."""
        c = self._memory.get(prompt)
        if c is None:
            c = self._load_disk(prompt)
            if c is None:
                c = self._encode(prompt)
                self._save_disk(prompt, c)
            self._memory[prompt] = c
        return c

    def precompute(self, prompts: list[str]) -> None:
        for p in dict.fromkeys(prompts):
            self.lookup(p)

    def get(
        self, prompts: list[str], device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> TextConditioning:
        """N prompts -> [N, ...] on `device` (default: the cache device) in `dtype` (default: the cache dtype)."""
        c = TextConditioning.cat([self.lookup(p) for p in prompts])
        return c.to(device or self.device, dtype or self.dtype)

    def _move_encoders(self, device) -> None:
        for enc in (self.pipe.text_encoder, self.pipe.text_encoder_2):
            if enc is not None:
                enc.to(device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def offload_encoders(self) -> None:
        """Move the text encoders to CPU (they come back only to encode a prompt that is not cached)."""
        self._move_encoders("cpu")
        self._offloaded = True

    def __len__(self) -> int:
        return len(self._memory)
