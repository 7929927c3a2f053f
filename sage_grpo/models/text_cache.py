"""Text conditioning: encode each distinct prompt once across the job, keep only its valid tokens.

The authors encode every prompt twice per rollout and keep the 7B text encoder on every GPU (their defect 12).
Here `TextEmbeddingCache` runs diffusers' `encode_prompt` (chat template, crop, glyph extraction for quoted text)
once per distinct string and keeps only the valid tokens of the two embeddings (the masks are right padding, so
they are implied by the lengths): ~120 x 3584 bf16 = 0.86 MB for a typical prompt instead of the padded
1000 x 3584 + 256 x 1472 (7.9 MB). `get` re-pads a batch to its longest valid length (zero embeddings, mask 0):
the transformer zeroes and masks padded text tokens and the valid-token attention cuts them anyway, so the output
equals the full-length one up to float rounding (tests/test_models_text_cache.py).

`precompute(prompts, info)` under torchrun splits the distinct prompts over the ranks: each rank encodes its share
and the results are shared through the disk cache when there is one (`--text_embedding_cache_dir`: each rank writes
its share, the others read the files when they need them; nothing stays in memory, the node's page cache holds one
copy) or else through all-gathers of the trimmed CPU tensors in bounded rounds (every rank then holds every prompt).
`release_encoders()` frees the text encoders once the prompt set is cached (device and host memory: an encoder
merely moved off the GPU would still hold ~15 GB of host memory beside the 16.6 GB transformer); with a `loader`
the cache loads them itself, only when a prompt is not cached, and an uncached prompt after the release loads
them for itself alone.

The disk cache is keyed by sha256(prompt + encoder identity), one safetensors file per prompt, written under a name
unique to the writer and renamed into place (several ranks or jobs may write the same prompt at once), never
rewritten once complete; an unreadable file is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from sage_grpo.errors import SageGRPOError
from sage_grpo.files import usual_permissions

__all__ = ["TextConditioning", "TextEmbeddingCache", "encoder_identity", "read_cache_file"]


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

    def pad_to(self, n_mllm: int, n_byt5: int) -> TextConditioning:
        """Right-pad the token dims to `n_mllm` / `n_byt5` with zero embeddings and mask 0 (valid tokens stay a
        prefix, as the transformer expects)."""
        def pad(t: Tensor, n: int) -> Tensor:
            if t.shape[1] >= n:
                return t
            return torch.cat([t, t.new_zeros(t.shape[0], n - t.shape[1], *t.shape[2:])], dim=1)

        return TextConditioning(pad(self.prompt_embeds, n_mllm), pad(self.prompt_mask, n_mllm),
                                pad(self.byt5_embeds, n_byt5), pad(self.byt5_mask, n_byt5))

    @staticmethod
    def cat(items: list[TextConditioning]) -> TextConditioning:
        """Concatenate along the batch, padded to the longest token dims (the cache hands each batch at its own
        longest valid length, e.g. prompts and the negative prompt of a CFG forward)."""
        n1 = max(c.prompt_embeds.shape[1] for c in items)
        n2 = max(c.byt5_embeds.shape[1] for c in items)
        return TextConditioning(*(torch.cat(ts, dim=0) for ts in zip(*(_fields(c.pad_to(n1, n2)) for c in items))))


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


@dataclass
class _Entry:
    """One prompt's valid tokens (CPU, the cache dtype): the masks are all ones over these lengths."""

    mllm: Tensor  # [n, D_text], n >= 1 (the chat template's closing tokens are always there)
    byt5: Tensor  # [m, D_byt5], m = 0 when the prompt quotes no text

    @property
    def nbytes(self) -> int:
        return self.mllm.nbytes + self.byt5.nbytes


def _prefix_length(mask: Tensor, what: str) -> int:
    m = mask.bool()
    n = int(m.sum())
    if not bool(m[:n].all()):
        raise SageGRPOError(f"the {what} mask has padding between valid tokens; the text cache keeps a valid prefix "
                            "only")
    return n


def _trim(c: TextConditioning) -> _Entry:
    """[1, L, D] padded conditioning -> its valid tokens. The clones drop the padded storage (a slice would keep it)."""
    n1 = _prefix_length(c.prompt_mask[0], "prompt")
    n2 = _prefix_length(c.byt5_mask[0], "glyph (ByT5)")
    return _Entry(c.prompt_embeds[0, :n1].clone(), c.byt5_embeds[0, :n2].clone())


def _pad(entries: list[_Entry]) -> TextConditioning:
    """Entries -> [N, ...] padded to the longest valid length of each stream; at least one token each, so no
    stream is ever empty (a masked zero token changes nothing)."""
    n1 = max(1, max(e.mllm.shape[0] for e in entries))
    n2 = max(1, max(e.byt5.shape[0] for e in entries))
    ref = entries[0].mllm
    pe = ref.new_zeros(len(entries), n1, ref.shape[1])
    be = ref.new_zeros(len(entries), n2, entries[0].byt5.shape[1])
    pm, bm = ref.new_zeros(len(entries), n1), ref.new_zeros(len(entries), n2)  # masks in the embedding dtype
    for i, e in enumerate(entries):
        pe[i, : e.mllm.shape[0]] = e.mllm
        pm[i, : e.mllm.shape[0]] = 1
        be[i, : e.byt5.shape[0]] = e.byt5
        bm[i, : e.byt5.shape[0]] = 1
    return TextConditioning(pe, pm, be, bm)


# Prompts each rank contributes to one all-gather round of a memory-only shared precompute, divided by the world
# size: a round moves at most ~1,024 trimmed prompts (~1 GB at 120 tokens) through every rank (on NCCL through its
# GPU: all_gather_object stages the pickled bytes there), whatever the number of ranks.
_ROUND_PROMPTS = 1024
_FORMAT = "trimmed-1"  # disk files: the valid tokens only; files of the padded format (masks stored) still load


def read_cache_file(path: Path, expect: dict[str, str], what: str, item: str) -> tuple[dict, dict] | None:
    """(tensors, metadata) of a cache file written by this module or sage_grpo.models.image_cond, or None when it
    is missing, its metadata differ from `expect` (another prompt's or image's, another encoder's), or it is
    unreadable: a file truncated by a crash or a foreign file is a miss (warned: "<what> cache file ... encoding
    the <item> again"), never an error."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        if any(meta.get(k) != v for k, v in expect.items()):
            return None
        return load_file(path), meta
    except Exception as e:  # noqa: BLE001 -- any unreadable file is a miss
        warnings.warn(f"{what} cache file {path} is unreadable ({type(e).__name__}: {e}); encoding the {item} again",
                      stacklevel=4)
        return None


class TextEmbeddingCache:
    """prompt -> its valid-token embeddings on CPU in `dtype`; `get` batches them, re-padded.

    pipe: a HunyuanVideo15Pipeline (its encoders may be None if every prompt is on disk).
    device: where the text encoders run. cache_dir: optional on-disk cache ("" / None = memory only). With a
    cache_dir nothing is held in memory: every `get` reads its prompts' files (~1 MB each, from the page cache,
    which the ranks of a node share), so host memory does not grow with the prompt set.
    """

    def __init__(self, pipe, device: torch.device | str, dtype: torch.dtype, cache_dir: str | Path | None = None,
                 loader=None):
        """loader: () -> (text_encoder, text_encoder_2), called the first time a prompt must be encoded while the
        pipeline holds no encoders (post_train.py loads none: a run whose prompts are all on disk never reads the
        7B encoder, and two ranks do not load it side by side for nothing)."""
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._memory: dict[str, _Entry] = {}
        self._on_disk: set[str] = set()  # prompts this process knows to have a file (for len())
        self._identity: str | None = None
        self._loader = loader
        self._released = False
        self.num_encoded = 0  # prompts run through the encoders by this process (tests and logs)

    @property
    def identity(self) -> str:
        if self._identity is None:
            self._identity = encoder_identity(self.pipe) + f":{self.dtype}"
        return self._identity

    @property
    def memory_bytes(self) -> int:
        """Bytes of embeddings held in memory (0 with a cache_dir)."""
        return sum(e.nbytes for e in self._memory.values())

    def _path(self, prompt: str) -> Path:
        key = hashlib.sha256(f"{self.identity}\n{prompt}".encode()).hexdigest()
        return self.cache_dir / f"{key}.safetensors"

    def _read(self, path: Path, prompt: str) -> _Entry | None:
        """The entry in `path`, or None when it is missing, another prompt's / encoder's, or unreadable."""
        found = read_cache_file(path, {"prompt": prompt, "identity": self.identity}, "text-embedding", "prompt")
        if found is None:
            return None
        t, meta = found
        if meta.get("format") == _FORMAT:
            return _Entry(t["mllm"], t["byt5"])
        return _trim(TextConditioning(t["prompt_embeds"], t["prompt_mask"], t["byt5_embeds"], t["byt5_mask"]))

    def _save_disk(self, prompt: str, entry: _Entry) -> None:
        path = self._path(prompt)
        if self._read(path, prompt) is not None:
            return  # another rank or job wrote it meanwhile: never rewrite a complete file
        # A name unique to this writer: several ranks (or jobs) sharing the directory write the same prompt at once;
        # a shared "<key>.tmp" let one rank rename another's file away (FileNotFoundError) or publish a mixed file.
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            save_file({"mllm": entry.mllm.contiguous(), "byt5": entry.byt5.contiguous()}, tmp,
                      metadata={"prompt": prompt, "identity": self.identity, "format": _FORMAT})
            usual_permissions(tmp)  # safetensors writes 0600: other users' jobs share the cache directory
            os.replace(tmp, path)  # atomic: a reader sees no file or a complete one
        except OSError as e:
            with contextlib.suppress(OSError):  # e.g. the directory could not be created: there is no file
                tmp.unlink(missing_ok=True)
            raise SageGRPOError(f"cannot write the text-embedding cache --text_embedding_cache_dir {self.cache_dir}: "
                                f"{e.strerror or e}") from e

    @torch.no_grad()
    def _encode(self, prompt: str) -> TextConditioning:
        pipe = self.pipe
        if (pipe.text_encoder is None or pipe.text_encoder_2 is None) and self._loader is not None:
            pipe.text_encoder, pipe.text_encoder_2 = (e.to(self.device) for e in self._loader())
            if self._released:  # freed once the prompt set was cached: loaded for this prompt only
                try:
                    return self._encode(prompt)
                finally:
                    self.release_encoders()
        if pipe.text_encoder is None or pipe.text_encoder_2 is None:
            raise SageGRPOError(
                f"prompt {prompt!r} is not in the text-embedding cache and the text encoders were not loaded; "
                "load them (load_text_encoders=True) to encode it"
            )
        # batch of 1: padded to the fixed lengths anyway, and identical to what the pipeline computes.
        pe, pm, be, bm = pipe.encode_prompt(prompt=[prompt], device=self.device, dtype=self.dtype, batch_size=1)
        self.num_encoded += 1
        warn_if_truncated(pipe, prompt)
        return TextConditioning(pe, pm, be, bm).to("cpu")

    def _entry(self, prompt: str) -> _Entry:
        """Memory, then disk, then the encoders (the result goes to disk if there is one, else to memory)."""
        e = self._memory.get(prompt)
        if e is not None:
            return e
        if self.cache_dir is not None:
            e = self._read(self._path(prompt), prompt)
        if e is None:
            e = _trim(self._encode(prompt))
            if self.cache_dir is None:
                self._memory[prompt] = e
            else:
                self._save_disk(prompt, e)
        if self.cache_dir is not None:
            self._on_disk.add(prompt)
        return e

    def lookup(self, prompt: str) -> TextConditioning:
        """One prompt -> [1, n, ...] on CPU, its valid tokens only (masks all ones, except an empty glyph stream:
        one masked zero token)."""
        return _pad([self._entry(prompt)])

    def precompute(self, prompts: list[str], info=None) -> None:
        """Make every prompt available. `info` (sage_grpo.parallel.dist.DistInfo) of a multi-rank run: COLLECTIVE,
        every rank must call it with the same prompts; each distinct prompt is then encoded by one rank only.
        Without `info` (or at world size 1) this process resolves every prompt itself."""
        distinct = list(dict.fromkeys(prompts))
        if info is None or not info.distributed:
            for p in distinct:
                self._entry(p)
            return
        self._precompute_shared(distinct, info.rank, info.world_size)

    def _precompute_shared(self, distinct: list[str], rank: int, world: int) -> None:
        import torch.distributed as dist

        def gather(obj) -> list:
            out: list = [None] * world
            dist.all_gather_object(out, obj)
            return out

        def run_all(fn) -> None:
            """fn() on this rank, then every rank raises the first failure of any rank: a rank that raised alone
            would leave the others waiting in the next collective until the timeout."""
            try:
                fn()
                err = None
            except Exception as e:  # noqa: BLE001 -- re-raised below, on every rank
                err = f"rank {rank}: {e}"
            errors = [x for x in gather(err) if x is not None]
            if errors:
                raise SageGRPOError(f"text-embedding precompute failed on {len(errors)} rank(s); {errors[0]}")

        digest = hashlib.sha256("\n".join(distinct).encode()).hexdigest()
        if len(set(gather(digest))) != 1:  # the split below is by position: every rank must see the same list
            raise SageGRPOError("the ranks were given different prompt lists to precompute (every rank must read the "
                                "same prompt file and validation prompts)")
        mine = distinct[rank::world]
        run_all(lambda: [self._entry(p) for p in mine])  # also the barrier: every share is on disk / in memory
        if self.cache_dir is not None:
            # Shared through the directory. A directory that is not shared by every node (node-local storage) shows
            # the other nodes' files missing: this rank encodes those itself.
            others = [p for i, p in enumerate(distinct) if i % world != rank]
            run_all(lambda: [self._entry(p) for p in others if not self._path(p).is_file()])
            self._on_disk.update(distinct)
            return
        # Memory only: all-gather the trimmed CPU tensors (pickled) in rounds. The number of rounds depends only on
        # the list and the world size, so every rank runs the same collectives.
        per_round = max(1, _ROUND_PROMPTS // world)
        rounds = math.ceil(math.ceil(len(distinct) / world) / per_round)
        for k in range(rounds):
            for part in gather({p: self._memory[p] for p in mine[k * per_round:(k + 1) * per_round]}):
                self._memory.update(part)

    def get(self, prompts: list[str], device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> TextConditioning:
        """N prompts -> [N, L, ...] on `device` (default: the cache device) in `dtype` (default: the cache dtype),
        L = the batch's longest valid length per stream (right padding: zero embeddings, mask 0)."""
        entries = {p: self._entry(p) for p in dict.fromkeys(prompts)}  # a repeated prompt is read once
        return _pad([entries[p] for p in prompts]).to(device or self.device, dtype or self.dtype)

    def release_encoders(self, loader=None) -> None:
        """Free the text encoders (the pipeline drops them; nothing else holds them) once the prompt set is cached;
        the loader (`loader`, or the one given at construction) brings them back for one prompt that is not cached
        and they are freed again after it."""
        import gc

        self.pipe.text_encoder = self.pipe.text_encoder_2 = None
        self._loader = loader or self._loader
        self._released = True
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __len__(self) -> int:
        return len(self._memory) + len(self._on_disk)
