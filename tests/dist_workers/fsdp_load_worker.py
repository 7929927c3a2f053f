"""torchrun worker (2 gloo ranks) for tests/test_parallel_fsdp.py::test_fsdp_load*: meta-device loading of each
rank's rows (single safetensors file and an index of shards), LoRA initialised as in the unsharded path, the sharded
anchor's local refresh, and a DCP round trip of the sharded model + optimizer. argv: out_dir, single_dir,
sharded_dir (diffusers transformer/ directories written by the test). Writes rank{r}.json and, from rank 0,
full_after_step.pt (the whole trained state, for the one-process load in the test)."""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import safetensors  # noqa: E402
from diffusers import HunyuanVideo15Transformer3DModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

from sage_grpo.checkpoint import dcp_load, dcp_save  # noqa: E402
from sage_grpo.config import OptimConfig  # noqa: E402
from sage_grpo.models.attention import use_valid_token_attention  # noqa: E402
from sage_grpo.models.fp8 import quantize_base  # noqa: E402
from sage_grpo.models.lora import (  # noqa: E402
    adapter_parameters,
    load_lora_sharded,
    lora_state_dict,
    merged_state_dict,
    save_lora,
    setup_trainable,
    sharded_lora_state,
)
from sage_grpo.models.parallelize import build_sharded_anchor, load_sharded_transformer  # noqa: E402
from sage_grpo.optim import build_optimizer  # noqa: E402
from sage_grpo.parallel.dist import init_distributed  # noqa: E402
from sage_grpo.parallel.fsdp import clone_local_shards, copy_local_shards_, local_rows  # noqa: E402

out_dir, single_dir, sharded_dir = (Path(a) for a in sys.argv[1:4])
info = init_distributed()
rank, world = info.rank, info.world_size
res: dict = {}
FP32 = torch.float32


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def inputs(seed, b=2):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(b, 9, 2, 4, 4, generator=g), timestep=torch.tensor([200.0, 700.0][:b]),
                encoder_hidden_states=torch.randn(b, 6, 32, generator=g),
                encoder_attention_mask=torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]][:b]),
                encoder_hidden_states_2=torch.randn(b, 4, 16, generator=g),
                encoder_attention_mask_2=torch.tensor([[1, 1, 0, 0]] * b), image_embeds=torch.zeros(b, 4, 16),
                return_dict=False)


def plain(path, seed=None, lora=None):
    """The unsharded model as post_train loads it (from_pretrained, fp32 master weights, LoRA after seeding)."""
    m = HunyuanVideo15Transformer3DModel.from_pretrained(path, torch_dtype=FP32)
    use_valid_token_attention(m)
    if lora is not None:
        torch.manual_seed(seed)
        setup_trainable(m, **lora)
    return m.eval()


class Recorder:
    """safetensors.safe_open that records every get_slice read (key, rows) and forbids get_tensor (a whole read)."""

    def __init__(self):
        self.reads: list[tuple[str, int, int]] = []
        self.whole = 0
        self.orig = safetensors.safe_open

    def __enter__(self):
        rec = self

        class Handle:
            def __init__(self, *a, **k):
                self.h = rec.orig(*a, **k)

            def keys(self):
                return self.h.keys()

            def get_tensor(self, key):
                rec.whole += 1
                return self.h.get_tensor(key)

            def get_slice(self, key):
                sl = self.h.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, idx):
                        t = sl[idx]
                        rec.reads.append((key, t.numel(), sl.get_shape()))
                        return t

                return Slice()

        safetensors.safe_open = Handle
        return self

    def __exit__(self, *exc):
        safetensors.safe_open = self.orig


def load_case(path):
    """Meta build + shard + each rank's rows; checks against the saved weights and the unsharded forward."""
    with Recorder() as rec:
        model, _ = load_sharded_transformer(path, info, master_dtype=FP32, param_dtype=FP32)
    saved = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        saved.update(load_file(f))  # test-only whole read, to compare against
    shards_equal, dtensors, storage_ok = True, True, True
    for name, p in model.named_parameters():
        dtensors &= isinstance(p, DTensor)
        start, n = local_rows(p)
        want = saved[name][start : start + n].to(FP32)
        loc = p.to_local()
        shards_equal &= torch.equal(loc, want)
        # the local storage holds one padded shard (ceil(rows / world) rows), never the whole tensor
        rows = p.shape[0]
        storage_ok &= loc.untyped_storage().nbytes() <= -(-rows // world) * (p.numel() // max(rows, 1)) * 4
    # every read is this rank's rows of one tensor: at most ceil(rows / world) rows (0-d tensors whole)
    rows_only = all(numel <= -(-shape[0] // world) * (max(1, int(torch.tensor(shape[1:]).prod())))
                    for _, numel, shape in rec.reads if len(shape))
    keys_read = {k for k, _, _ in rec.reads}
    ref = plain(path)
    with torch.no_grad():
        y = model(**inputs(0))[0]
        y_ref = ref(**inputs(0))[0]
    return dict(shards_equal=shards_equal, dtensors=dtensors, storage_ok=storage_ok, rows_only=rows_only,
                whole_reads=rec.whole, keys_read=len(keys_read), n_saved=len(saved), n_reads=len(rec.reads),
                fwd_diff=float((y - y_ref).abs().max()), fwd_scale=float(y_ref.abs().max()))


res["single"] = load_case(single_dir)
res["sharded"] = load_case(sharded_dir)

# --- LoRA: adapters equal the unsharded path's (same seed, same draws), RNG left in the same state -----------------
LORA = dict(use_lora=True, lora_r=4, lora_alpha=8)
torch.manual_seed(7)
lmodel, trainable = load_sharded_transformer(single_dir, info, master_dtype=FP32, param_dtype=FP32, lora=LORA)
rng_after = torch.get_rng_state()
lref = plain(single_dir, seed=7, lora=LORA)
rng_ref = torch.get_rng_state()
ref_params = dict(lref.named_parameters())
res["lora"] = dict(
    all_equal=all(torch.equal(full(p).detach(), ref_params[n].detach()) for n, p in lmodel.named_parameters()),
    names_equal=sorted(n for n, _ in lmodel.named_parameters()) == sorted(ref_params),
    a_nonzero=all(float(full(p).abs().sum()) > 0 for n, p in lmodel.named_parameters() if "lora_A" in n),
    trainable_equal=sorted(n for n, p in lmodel.named_parameters() if p.requires_grad)
    == sorted(n for n, p in lref.named_parameters() if p.requires_grad),
    n_trainable=len(trainable),
    rng_equal=torch.equal(rng_after, rng_ref),
)
# a trained-looking adapter: merged weights of the sharded model (DCP's `transformer/` of a LoRA run) equal unsharded
with torch.no_grad():
    for i, (n, p) in enumerate(adapter_parameters(lmodel).items()):
        g = torch.Generator().manual_seed(i)  # the same on every rank (str hashes differ between processes)
        delta = torch.randn(p.shape, generator=g) * 0.01
        p.to_local().add_(delta[slice(*[(s := local_rows(p))[0], s[0] + s[1]])])
        dict(lref.named_parameters())[n].add_(delta)
    merged = merged_state_dict(lmodel)
    merged_ref = merged_state_dict(lref)
res["lora"]["merged_equal_keys"] = sorted(merged) == sorted(merged_ref)
res["lora"]["merged_diff"] = max(float((full(v) - merged_ref[k]).abs().max()) for k, v in merged.items())
# LoRA checkpoint under FSDP2: gathered on every rank (small), written by rank 0 as save_lora does, read back by a
# fresh sharded model row by row
gathered = sharded_lora_state(lmodel)
want = lora_state_dict(lref)
res["lora"]["gathered_equal"] = sorted(gathered) == sorted(want) and all(
    torch.equal(gathered[k], want[k]) for k in want)
if rank == 0:
    save_lora(lref, out_dir / "lora")  # the unsharded writer: the file format the sharded reader must take
dist.barrier()
lmodel2, _ = load_sharded_transformer(single_dir, info, master_dtype=FP32, param_dtype=FP32, lora=LORA)
load_lora_sharded(lmodel2, out_dir / "lora")
res["lora"]["reload_equal"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in
                                  zip(adapter_parameters(lmodel2).values(), adapter_parameters(lmodel).values()))

# --- an FP8 base (--fp8_base): each rank quantizes its rows as it reads them; FSDP2 shards and gathers the bytes ----
BF16 = torch.bfloat16
with Recorder() as rec:
    torch.manual_seed(7)
    fmodel, _ = load_sharded_transformer(single_dir, info, master_dtype=FP32, param_dtype=BF16, base_dtype=BF16,
                                         lora=LORA | {"adapter_dtype": FP32}, fp8={"fp8_matmul": False})
fref = HunyuanVideo15Transformer3DModel.from_pretrained(single_dir, torch_dtype=BF16)
use_valid_token_attention(fref)
n_fp8 = quantize_base(fref, "cpu")
torch.manual_seed(7)
setup_trainable(fref, **LORA, adapter_dtype=FP32)
fref_state = fref.state_dict()
fp8_params = {n: p for n, p in fmodel.named_parameters() if n.endswith((".fp8_data", ".fp8_scale_bits"))}
# as predict_velocity runs a bf16 base: the latents and text in bf16, the timestep in fp32, under autocast
binputs = {k: v.to(BF16) if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v
           for k, v in inputs(0).items()}
with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
    fy = fmodel(**binputs)[0]
    fy_ref = fref.eval()(**binputs)[0]
res["fp8"] = dict(
    n_layers=n_fp8, n_params=len(fp8_params),
    # the FP8 data and scales are sharded by rows as stored (uint8 / int32: FSDP2's mixed precision leaves them)
    sharded=all(isinstance(p, DTensor) and p.to_local().shape[0] == -(-p.shape[0] // world)
                and p.dtype in (torch.uint8, torch.int32) for p in fp8_params.values()),
    # gathered, they are the one-process quantization bitwise, and so is everything else
    equal=sorted(n for n, _ in fmodel.named_parameters()) == sorted(fref_state)
    and all(torch.equal(full(p).detach(), fref_state[n]) for n, p in fmodel.named_parameters()),
    # a bf16 weight is read only as this rank's rows, never whole
    rows_only=rec.whole == 0 and all(numel <= -(-shape[0] // world) * int(torch.tensor(shape[1:]).prod())
                                     for _, numel, shape in rec.reads if len(shape) > 1),
    fwd_diff=float((fy.float() - fy_ref.float()).abs().max()), fwd_scale=float(fy_ref.float().abs().max()),
)
del fmodel, fref


# --- anchor: frozen sharded copy, refreshed shard to shard with no collective -------------------------------------
class NoCollectives:
    """Forbids the c10d collectives (every public one raises) and counts DTensor / functional collectives."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "barrier")

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(dist, n, self._forbid(n))
        self.mode = CommDebugMode()
        self.mode.__enter__()
        return self

    @staticmethod
    def _forbid(name):
        def f(*a, **k):
            raise AssertionError(f"collective {name} during a local-shard copy")
        return f

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for n, f in self.saved.items():
            setattr(dist, n, f)
        self.count = self.mode.get_total_counts()


policy, _ = load_sharded_transformer(single_dir, info, master_dtype=FP32, param_dtype=FP32, lora={"use_lora": False})
with NoCollectives() as nc:
    anchor = build_sharded_anchor(policy, info)
init_count = nc.count
anchor_equal_init = all(torch.equal(a.to_local(), p.to_local()) for a, p in
                        zip(anchor.module.parameters(), policy.parameters()))
ptrs = [a.to_local().data_ptr() for a in anchor.module.parameters()]
with torch.no_grad():  # the policy moves (a fake update on the local shards)
    for p in policy.parameters():
        p.to_local().add_(0.01)
anchor_stale = not any(torch.equal(a.to_local(), p.to_local()) for a, p in
                       zip(anchor.module.parameters(), policy.parameters()) if p.to_local().numel())
with NoCollectives() as nc:
    anchor.refresh()
res["anchor"] = dict(
    init_collectives=init_count, refresh_collectives=nc.count, equal_init=anchor_equal_init, stale=anchor_stale,
    equal_after=all(torch.equal(a.to_local(), p.to_local())
                    for a, p in zip(anchor.module.parameters(), policy.parameters())),
    same_storage=ptrs == [a.to_local().data_ptr() for a in anchor.module.parameters()],
    frozen=not any(a.requires_grad for a in anchor.module.parameters()),
)
with torch.no_grad():
    res["anchor"]["fwd_diff"] = float((anchor.module(**inputs(1))[0] - policy(**inputs(1))[0]).abs().max())
# offloaded anchor (FSDP2 CPUOffloadPolicy), bf16 compute over fp32 master shards: forward equals the policy's
pol16, _ = load_sharded_transformer(single_dir, info, master_dtype=FP32, param_dtype=torch.bfloat16,
                                    lora={"use_lora": False})
off = build_sharded_anchor(pol16, info, param_dtype=torch.bfloat16, offload=True)
# inputs in bf16 but the timestep fp32, under bf16 autocast, as predict_velocity feeds the model: FSDP2 does not cast
# forward inputs (cast_forward_inputs=False, sage_grpo/parallel/fsdp.py)
x16 = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v
       for k, v in inputs(1).items()}
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    y_off, y_pol = off.module(**x16)[0], pol16(**x16)[0]
res["anchor"]["offload_fwd_equal"] = y_off.dtype == torch.bfloat16 and torch.equal(y_off, y_pol)
res["anchor"]["offload_on_cpu"] = all(p.device.type == "cpu" for p in off.module.parameters())
# LoRA moving anchor: the second adapter set is cloned and copied back shard by shard, also collective-free
with NoCollectives() as nc:
    second = clone_local_shards(adapter_parameters(lmodel))
    copy_local_shards_(list(adapter_parameters(lmodel).values()), list(second.values()))
res["anchor"]["lora_collectives"] = nc.count
res["anchor"]["lora_sharded"] = all(isinstance(v, DTensor) and v.to_local().shape == p.to_local().shape
                                    for v, p in zip(second.values(), adapter_parameters(lmodel).values()))

# --- DCP: sharded model + Muon/AdamW saved on 2 ranks, loaded on 2 ranks exactly; one more step equal --------------
OCFG = dataclasses.replace(OptimConfig(), learning_rate=1e-3, weight_decay=0.1, use_muon=True)


def train_step(model, opt, seed):
    model.train()
    x = inputs(seed)
    x = {k: (v[rank : rank + 1] if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    model(**x)[0].pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


m1, _ = load_sharded_transformer(single_dir, info, master_dtype=FP32, param_dtype=FP32, lora={"use_lora": False})
o1 = build_optimizer(list(m1.named_parameters()), OCFG)
train_step(m1, o1, 3)
ck = out_dir / "ckpt"
dcp_save({"model": get_model_state_dict(m1)}, ck / "transformer")
dcp_save({"optimizer": get_optimizer_state_dict(m1, o1.optimizers)}, ck / "optimizer")
whole = get_model_state_dict(m1, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # rank 0 keeps it
if rank == 0:
    torch.save(whole, out_dir / "full_after_step.pt")

m2, _ = load_sharded_transformer(single_dir, info, master_dtype=FP32, param_dtype=FP32, lora={"use_lora": False})
o2 = build_optimizer(list(m2.named_parameters()), OCFG)
model_state = {"model": get_model_state_dict(m2)}
dcp_load(model_state, ck / "transformer", "transformer weights")
set_model_state_dict(m2, model_state["model"])
opt_state = {"optimizer": get_optimizer_state_dict(m2, o2.optimizers)}
dcp_load(opt_state, ck / "optimizer", "optimizer state")
set_optimizer_state_dict(m2, o2.optimizers, opt_state["optimizer"])


def opt_states_equal(a, b, ma, mb):
    pa, pb = dict(ma.named_parameters()), dict(mb.named_parameters())
    ok = True
    for oa, ob in zip(a.optimizers, b.optimizers):
        ida = {id(p): n for n, p in pa.items()}
        idb = {id(p): n for n, p in pb.items()}
        sa = {ida[id(p)]: s for p, s in oa.state.items()}
        sb = {idb[id(p)]: s for p, s in ob.state.items()}
        ok &= sorted(sa) == sorted(sb)
        for n in sa:
            for k, v in sa[n].items():
                w = sb[n][k]
                va = v.to_local() if isinstance(v, DTensor) else v
                vb = w.to_local() if isinstance(w, DTensor) else w
                ok &= torch.equal(torch.as_tensor(va), torch.as_tensor(vb))
    return ok


res["dcp"] = dict(
    model_equal=all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(m1.parameters(), m2.parameters())),
    optim_equal=opt_states_equal(o1, o2, m1, m2),
    muon_class=type(o2["muon"]).__name__,
)
train_step(m1, o1, 4)
train_step(m2, o2, 4)
res["dcp"]["next_step_equal"] = all(torch.equal(a.to_local(), b.to_local())
                                    for a, b in zip(m1.parameters(), m2.parameters()))

(out_dir / f"rank{rank}.json").write_text(json.dumps(res))
dist.barrier()
dist.destroy_process_group()
