"""The planner (sage_grpo.memory; its command line scripts/plan_memory.py): exact parameter counts on meta, the
activation model against saved-tensor bytes, the sharding arithmetic, the FP8 base's terms, the CLI (one message
for an impossible geometry) and post_train.py's preflight against a GPU's memory."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import measure_memory as mm  # noqa: E402
import plan_memory as pm  # noqa: E402

import sage_grpo.memory as mem  # noqa: E402
from sage_grpo.config import Config, config_from_dict, read_yaml  # noqa: E402
from sage_grpo.errors import SageGRPOError  # noqa: E402
from sage_grpo.models.tiny import tiny_transformer_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def counts():
    """Counts of the real 480p_t2v transformer (meta) and the frozen parts, shared by the plan tests."""
    return mem.count_transformer(mem.build_transformer(mem.TRANSFORMER_CONFIGS["480p_t2v"])), mem.count_frozen_parts()


@pytest.fixture(scope="module")
def lora_counts():
    """The same transformer's counts with LoRA adapters (r 8, every linear layer of the blocks)."""
    return mem.count_transformer(mem.build_transformer(mem.TRANSFORMER_CONFIGS["480p_t2v"]), use_lora=True)


def test_meta_count_equals_real_tiny_model():
    cfg = tiny_transformer_config()
    meta = mem.count_transformer(mem.build_transformer(cfg, "meta"))
    real = mem.build_transformer(cfg, "cpu")
    assert next(real.parameters()).device.type == "cpu"
    assert meta["total"] == sum(t.numel() for t in real.state_dict().values())
    block0 = [t for k, t in real.state_dict().items() if k.startswith("transformer_blocks.0.")]
    assert meta["per_block"] == sum(t.numel() for t in block0)
    # LoRA through the project's setup_trainable: the meta count equals the real adapter tensors
    lora_meta = mem.count_transformer(mem.build_transformer(cfg, "meta"), use_lora=True, lora_r=4)
    real_lora = mem.build_transformer(cfg, "cpu")
    mem.count_transformer(real_lora, use_lora=True, lora_r=4)
    assert lora_meta["trainable"] == sum(t.numel() for k, t in real_lora.state_dict().items() if "lora_" in k) > 0


def test_real_transformer_count_matches_gpu_facts(counts):
    c, frozen = counts
    assert (c["total"], c["per_block"], c["num_blocks"]) == (8_326_608_160, 151_056_896, 54)  # gpu_facts.md
    assert c["trainable"] == c["total"] and 8_153_726_976 < c["muon"] < c["total"]  # blocks' 2-D + refiner's 2-D
    assert 7.0e9 < frozen["text_encoder"] < 7.1e9 and 2.2e9 < frozen["reward"] < 2.22e9


# (heads, head_dim, mlp_ratio, batch, latent F/H/W, text MLLM/ByT5/image, valid MLLM/ByT5, attention, dtype)
GEOMETRIES = [
    (2, 64, 4.0, 1, (2, 8, 8), (48, 16, 8), (20, 4), "valid", torch.bfloat16),
    (4, 32, 2.0, 2, (3, 4, 6), (40, 12, 6), (33, 5), "valid", torch.float32),
    (3, 64, 4.0, 2, (2, 4, 8), (24, 8, 4), (10, 2), "diffusers", torch.bfloat16),
]


@pytest.mark.parametrize("geom", GEOMETRIES, ids=["valid-bf16-b1", "valid-fp32-b2-mlp2", "diffusers-bf16-b2"])
def test_activation_model_matches_saved_tensors(geom):
    heads, hd, ratio, b, latent, text, valid, attention, dtype = geom
    for ckpt in (False, True):
        kw = dict(mlp_ratio=ratio, batch=b, latent=latent, text=text, valid=valid, attention=attention,
                  checkpointing=ckpt, dtype=dtype)
        measured = mm.block_saved_bytes(heads, hd, **kw)
        predicted = mm.predicted_block_bytes(heads, hd, **kw)
        assert measured > 0
        assert abs(predicted / measured - 1) < 0.02, (ckpt, predicted, measured)  # stated tolerance: 2%


def test_activation_model_matches_gpu_facts():
    rows = mem.validate_against_gpu_facts()
    blocks = [r for r in rows if r["what"].startswith("block")]
    assert len(blocks) == 4
    for r in blocks:
        assert abs(r["ratio"] - 1) < 0.03, r  # stated tolerance vs the H100 measurements: 3%


def test_sp_splits_video_tokens_not_text():
    kw = dict(batch=2, video_tokens=1000, text_tokens=100, dim=64, heads=4, mlp_dim=256, elem=2)
    one = mem.block_activation_bytes(sp=1, checkpointing=True, **kw)
    two = mem.block_activation_bytes(sp=2, checkpointing=True, **kw)
    assert one == 2 * 1100 * 64 * 2 and two == 2 * 600 * 64 * 2
    assert mem.block_activation_bytes(sp=2, **kw) < mem.block_activation_bytes(sp=1, **kw)


def _cfg(path="configs/single_node_8gpu.yaml", **over) -> Config:
    cfg = config_from_dict(read_yaml(ROOT / path))
    for k, v in over.items():
        group = next(g for g in dataclasses.fields(cfg) if hasattr(getattr(cfg, g.name), k))
        setattr(getattr(cfg, group.name), k, v)
    return cfg


def test_sharding_arithmetic(counts):
    c, frozen = counts
    run = lambda cfg, world: mem.plan(cfg, mem.PlanOptions(world_size=world), c, frozen)["terms_gib"]  # noqa: E731
    a, b = run(_cfg(reference_mode_offload=False), 8), run(_cfg(reference_mode_offload=False), 16)  # dp_shard 4 -> 8
    for k in ("policy "
              "weights", "gradients", "optimizer state", "anchor (resident)", "muon gather + Newton-Schulz (est)"):
        assert b[k] == pytest.approx(a[k] / 2), k
    for k in ("vae weights", "reward model", "trajectory", "activations (update)"):
        assert b[k] == pytest.approx(a[k]), k
    assert a["anchor (resident)"] == pytest.approx(a["policy weights"])
    h = run(_cfg(dp_replicate=2), 16)  # HSDP: replicate 2 x shard 4 -> the 8-GPU shard size
    assert h["policy weights"] == pytest.approx(a["policy weights"])
    full = run(_cfg(enable_fsdp=False), 8)
    assert full["policy weights"] == pytest.approx(8 * a["policy weights"])
    n = c["total"]
    assert a["policy weights"] == pytest.approx(n * 4 / 8 / mem.GIB)  # fp32 master, 8 shards
    assert a["optimizer state"] == pytest.approx((c["muon"] + 2 * (n - c["muon"])) * 4 / 8 / mem.GIB)
    adam = run(_cfg(use_muon=False), 8)
    assert adam["optimizer state"] == pytest.approx(2 * n * 4 / 8 / mem.GIB)


def test_offload_checkpointing_and_accumulation(counts):
    c, frozen = counts
    run = lambda cfg: mem.plan(cfg, mem.PlanOptions(world_size=8), c, frozen)  # noqa: E731
    base = run(_cfg())
    assert base["terms_gib"]["anchor (resident)"] == 0 and base["terms_gib"]["text encoders after offload"] == 0
    resident = run(_cfg(reference_mode_offload=False))
    assert resident["terms_gib"]["anchor (resident)"] == pytest.approx(base["terms_gib"]["policy weights"])
    assert resident["phases_gib"]["rollout"] == pytest.approx(
        base["phases_gib"]["rollout"] + resident["terms_gib"]["anchor (resident)"])
    # without FSDP the offloaded anchor comes to the GPU whole for its phase
    assert run(_cfg(enable_fsdp=False))["terms_gib"]["anchor (on GPU in its phase)"] == pytest.approx(
        8 * base["terms_gib"]["policy weights"])
    no_ckpt = run(_cfg(enable_gradient_checkpointing=False))
    assert no_ckpt["terms_gib"]["activations (update)"] > 10 * base["terms_gib"]["activations (update)"]
    assert not no_ckpt["fits"] and base["fits"]
    acc = run(_cfg(gradient_accumulation_steps=8, save_interval=200))
    assert acc["setting"]["videos_per_update"] == 64
    assert acc["phases_gib"]["rollout"] == pytest.approx(base["phases_gib"]["rollout"] + base["terms_gib"]["gradients"])


def test_cli_json(capsys):
    pl = pm.main(["--config", str(ROOT / "configs/single_node_8gpu.yaml"), "--world_size", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] == pl["fits"] and out["setting"]["sp_size"] == 2 and out["peak_gib"] > 0


@pytest.mark.parametrize("argv,needle", [
    (["--world_size", "8", "--sp_size", "3"], "--sp_size 3 must divide"),
    (["--world_size", "8", "--pretrained_transformer_version", "720p_i2v_distilled_sparse"], "no transformer config"),
])
def test_impossible_geometry_is_one_message(argv, needle, capsys):
    from sage_grpo.errors import run_cli

    with pytest.raises(SystemExit) as exc:
        run_cli(pm.main, ["--config", str(ROOT / "configs/single_node_8gpu.yaml"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err and err.count("\n") == 1


def test_a_batch_of_incomplete_groups_is_planned_with_the_next_batch_that_makes_whole_ones(counts):
    """dp 3 x batch 2 = 6 videos are not whole groups of 4: post_train.py refuses them, so the plan is of --batch_size
    4 (12 videos, 3 groups), said in a note; a batch that already makes whole groups is left as it is."""
    cfg = _cfg()  # sp 2, batch 2, G 4
    note = mem.whole_groups(cfg, 6)
    assert cfg.data.batch_size == 4 and "--batch_size 2 on 3 data-parallel rank(s) makes 6 videos" in note
    assert "planned with --batch_size 4" in note
    mem.plan(cfg, mem.PlanOptions(world_size=6), *counts)  # a geometry validate accepts
    again = _cfg()
    assert mem.whole_groups(again, 8) is None and again.data.batch_size == 2  # dp 4 x 2 = 8 videos: two groups
    assert [mem.whole_groups_batch(_cfg(batch_size=b), 2) for b in (1, 2, 3, 5)] == [4, 4, 4, 8]  # dp 1: G | batch


def test_a_plan_that_does_not_fit_lists_what_would_fit_each_re_planned(counts, lora_counts):
    """The README's one-GPU LoRA flags on a 24 GiB card: every change listed alone is re-planned (the same peak as a
    plan of the flags it names), largest saving first; together, in that order, they end in a plan that fits, and
    the flags of the last line, planned from scratch, give its peak."""
    from sage_grpo.config import load_config

    c, frozen = counts
    lora = lora_counts
    base = ["--use_lora", "True", "--master_weight_type", "bf16", "--enable_fsdp", "False", "--batch_size", "4",
            "--num_generations", "4"]
    opts = mem.PlanOptions(world_size=1, gpu_memory_gib=24)

    def peak(flags: str) -> float:
        argv = base + flags.replace("URL", mem.REMOTE_URL).split()
        return mem.plan(load_config(argv), opts, lora, frozen)["peak_gib"]

    assert not mem.plan(load_config(base), opts, lora, frozen)["fits"]
    ch = mem.fitting_changes(load_config(base), opts, lora, frozen)
    savings = [r["saving_gib"] for r in ch["alone"]]
    assert savings == sorted(savings, reverse=True) and len(savings) >= 3 and savings[-1] > 0
    names = " ".join(r["flags"] for r in ch["alone"])
    assert "--reward_model remote" in names and "--cfg_scale 1" in names and "--use_lora" not in names  # has LoRA
    for r in ch["alone"]:
        assert r["peak_gib"] == pytest.approx(peak(r["flags"])), r["flags"]
    together = ch["together"]
    assert ch["fits"] and together[-1]["fits"] and together[-1]["peak_gib"] <= 24
    assert all(a["peak_gib"] > b["peak_gib"] for a, b in zip(together, together[1:]))
    assert together[-1]["peak_gib"] == pytest.approx(peak(" ".join(r["flags"] for r in together)))
    assert not any(r["fits"] for r in together[:-1])  # it stops at the first that fits


def test_the_cli_exits_1_with_the_changes_when_the_plan_does_not_fit(counts, lora_counts, capsys, monkeypatch):
    """`plan_memory.py --world_size 1 --gpu_memory_gib 24` (the defaults: full fine-tuning of 2 videos, G 4) plans
    (batch 4, said in a note), does not fit, names the flags that fit 24 GiB and exits 1; at 160 GiB it fits and
    exits 0 with no changes listed; --help describes it."""
    c, frozen = counts
    monkeypatch.setattr(mem, "build_transformer", lambda config: None)  # the counts of the fixtures, counted once
    monkeypatch.setattr(mem, "count_transformer", lambda model, use_lora=False, **kw: lora_counts if use_lora else c)
    monkeypatch.setattr(mem, "count_frozen_parts", lambda: frozen)
    assert pm.cli(["--world_size", "1", "--gpu_memory_gib", "24"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit in 24 GiB" in out and "note: --batch_size 2 on 1 data-parallel rank(s)" in out
    assert "  --use_lora True " in out and "\nfits 24 GiB with: --use_lora True" in out
    assert pm.cli(["--world_size", "1", "--gpu_memory_gib", "160"]) == 0
    out = capsys.readouterr().out
    assert "fits in 160 GiB" in out and "changes that lower the peak" not in out
    with pytest.raises(SystemExit) as exc:
        pm.main(["--help"])
    assert exc.value.code == 0 and "Per-GPU memory plan of a post_train.py run" in capsys.readouterr().out


def test_text_cache_host_memory_per_rank(counts, tiny_pipe):
    """10,000 typical prompts (120 valid MLLM tokens, no quoted text) in bf16: 8.6 GB per rank held in memory, none
    with a cache directory, against 79 GB padded; the per-prompt formula is what the cache really holds."""
    from sage_grpo.models.text_cache import TextEmbeddingCache

    c, frozen = counts
    h = mem.plan(_cfg(), mem.PlanOptions(world_size=8), c, frozen)["host_text_cache"]
    assert (h["num_prompts"], h["prompt_tokens"], h["glyph_tokens"]) == (10_000, 120, 0)
    assert h["in_memory_gb"] == pytest.approx(10_000 * 120 * 3584 * 2 / 1e9)
    assert h["per_rank_gb"] == 0  # under torchrun the cache directory defaults to output_dir/text_embeddings
    one = mem.plan(_cfg(sp_size=1, enable_fsdp=False, batch_size=4), mem.PlanOptions(world_size=1), c,
                  frozen)["host_text_cache"]
    assert one["per_rank_gb"] == h["in_memory_gb"]  # one process without a cache dir holds every prompt
    assert h["padded_before_gb"] == pytest.approx(10_000 * (1000 * 3584 + 256 * 1472 + 1256) * 2 / 1e9)
    assert h["padded_before_gb"] > 9 * h["in_memory_gb"] and h["encoded_per_rank"] == 1250
    with_dir = mem.plan(_cfg(text_embedding_cache_dir="/shared/cache"), mem.PlanOptions(world_size=8), c, frozen)
    assert with_dir["host_text_cache"]["per_rank_gb"] == 0 < with_dir["host_text_cache"]["files_gb"]
    assert "host memory per rank, text-embedding cache: 10,000 prompts" in pm.render(with_dir)
    # the formula against the cache itself (tiny widths, fp32)
    prompts = ["a cat", 'a sign that says "OPEN"']
    cache = TextEmbeddingCache(tiny_pipe, "cpu", torch.float32)
    cache.precompute(prompts)
    tc = tiny_pipe.transformer.config
    want = 0
    for p in prompts:
        one = cache.lookup(p)
        want += mem.text_cache_bytes(prompt_tokens=int(one.prompt_mask.sum()), glyph_tokens=int(one.byt5_mask.sum()),
                                    elem=4, text_dim=tc.text_embed_dim, byt5_dim=tc.text_embed_2_dim)
    assert cache.memory_bytes == want


def test_text_cache_options_are_checked(counts):
    c, frozen = counts
    with pytest.raises(SageGRPOError, match="--prompt_tokens must be in 1..1000"):
        mem.plan(_cfg(), mem.PlanOptions(world_size=8, prompt_tokens=1001), c, frozen)


def test_traffic_arithmetic_against_an_independent_count(counts):
    """The 64-GPU config's collectives per step, per rank, counted here from what each rank holds and needs."""
    c, frozen = counts
    P, Pt, Pm = c["total"], c["trainable"], c["muon"]
    opts = mem.PlanOptions(world_size=64)
    full = lambda **kw: mem.plan(_cfg("configs/multinode_64gpu.yaml", dp_replicate=1, **kw), opts, c, frozen)  # noqa: E731
    # batch 2 at one sample per micro-step: 20 steps x 2 rollout forwards; all 20 steps of sage_grpo inject noise
    # and timestep_fraction 1 trains them all: 40 update steps, each with an anchor forward (dual KL)
    regather = full(rollout_reshard_after_forward=True)
    assert regather["loop"] == {"rollout_forwards": 40, "update_steps": 40, "anchor_forwards": 40,
                                "optimizer_steps": 1.0}
    # full shard over 64 ranks (8 nodes): a forward's all-gather brings each rank the 63 shards it does not hold
    # (bf16); the estimate: ~16.6 GB per forward, ~660 GB for the rollout's 40 forwards
    per_forward = P * 2 - P * 2 / 64
    assert 16.3e9 < per_forward < 16.6e9
    assert regather["traffic"]["param all-gather: rollout"]["gib"] * mem.GIB == pytest.approx(40 * per_forward)
    assert 650e9 < 40 * per_forward < 660e9
    # every rank sends every fp32 gradient row but its own per backward; ShardedMuon sends its rows of the 63/64 of
    # the Muon matrices other ranks own and gets the same back
    grads = Pt * 4 * (1 - 1 / 64) * 40
    muon = 2 * (Pm / 64) * (63 / 64) * 2
    expect = (40 + 2 * 40 + 40) * per_forward + grads + muon  # rollout, update fwd + bwd, anchor; all cross nodes
    assert regather["traffic"]["inter_node_gib"] * mem.GIB == pytest.approx(expect)
    assert regather["traffic"]["intra_node_gib"] == 0
    kept = full(rollout_reshard_after_forward=False)  # one gather for the whole rollout instead of 40
    assert kept["traffic"]["inter_node_gib"] * mem.GIB == pytest.approx(expect - 39 * per_forward)
    # the kept-gathered rollout holds the whole bf16 transformer instead of two blocks + the root
    blocks_and_root = 2 * c["per_block"] + (P - c["num_blocks"] * c["per_block"])
    assert (kept["phases_gib"]["rollout"] - regather["phases_gib"]["rollout"]) * mem.GIB == pytest.approx(
        (P - blocks_and_root) * 2)

    # the config's default: HSDP, a shard group of 8 consecutive ranks = one node; only the replicas' gradient
    # all-reduce crosses nodes: a ring all-reduce of a rank's fp32 gradient shard (1/8) over 8 replicas per backward
    hsdp = mem.plan(_cfg("configs/multinode_64gpu.yaml"), opts, c, frozen)
    assert hsdp["setting"]["shard_ranks"] == 8 and hsdp["setting"]["dp_replicate"] == 8
    assert not hsdp["setting"]["rollout_reshard_after_forward"]
    ring_all_reduce = 2 * (8 - 1) * (Pt * 4 / 8) / 8
    assert hsdp["traffic"]["inter_node_gib"] * mem.GIB == pytest.approx(40 * ring_all_reduce)
    node_gather = P * 2 * 7 / 8  # the 7 other shards of the node
    assert hsdp["traffic"]["param all-gather: update fwd + bwd"]["gib"] * mem.GIB == pytest.approx(80 * node_gather)
    assert hsdp["traffic"]["inter_node_gib"] < kept["traffic"]["inter_node_gib"] / 10 and hsdp["fits"]
    # 8 GPUs: nothing crosses a node
    one = mem.plan(_cfg(), mem.PlanOptions(world_size=8), c, frozen)
    assert one["traffic"]["inter_node_gib"] == 0 and one["traffic"]["intra_node_gib"] > 0


def test_cli_prints_the_layout_choices(capsys):
    pm.main(["--config", str(ROOT / "configs/multinode_64gpu.yaml"), "--world_size", "64"])
    out = capsys.readouterr().out
    assert "total inter-node / intra-node" in out
    rows = [line for line in out.splitlines() if line.startswith(("full shard over 64", "HSDP: shard over 8"))]
    assert len(rows) == 4 and sum("kept gathered" in r for r in rows) == 2


def test_i2v_plans_the_image_tokens_siglip_and_the_image_conditioning(counts):
    """The same run as I2V: 729 more valid encoder tokens per block, SigLIP (the so400m vision tower, ~0.43 B
    parameters) on the GPU while the images are encoded, offloaded with the text encoders, and each video's image
    conditioning (729 x 1152 SigLIP tokens + the frame-0 latent) in the trajectory; every version is planned."""
    c, frozen = counts
    assert 0.42e9 < frozen["image_encoder"] < 0.44e9
    assert set(mem.TRANSFORMER_CONFIGS) >= {"480p_i2v", "720p_i2v", "480p_i2v_step_distilled"}
    cfg = _cfg()
    t2v = mem.plan(cfg, mem.PlanOptions(world_size=8), c, frozen)
    cfg.model.pretrained_transformer_version = "480p_i2v"
    i2v = mem.plan(cfg, mem.PlanOptions(world_size=8), c, frozen)
    assert i2v["setting"]["text_tokens"] == t2v["setting"]["text_tokens"] + 729
    gib, e = 2**30, 2  # bf16
    assert cfg.model.offload_text_encoder  # the config offloads: SigLIP counts in the encode phase only
    C, F, H, W = i2v["setting"]["latent"]
    per_video = (729 * 1152 + C * H * W) * e
    ti, tt = i2v["terms_gib"], t2v["terms_gib"]
    assert ti["trajectory"] - tt["trajectory"] == pytest.approx(cfg.data.batch_size * per_video / gib)
    assert ti["image encoder before offload"] == pytest.approx(frozen["image_encoder"] * e / gib)
    assert ti["image encoder after offload"] == tt["image encoder before offload"] == 0
    encode = i2v["phases_gib"]["encode"] - t2v["phases_gib"]["encode"]
    assert encode == pytest.approx(ti["image encoder before offload"])
    assert i2v["host_image_cache"]["per_image_mb"] == pytest.approx(per_video / 1e6) and t2v["host_image_cache"] is None


def test_a_remote_reward_takes_the_reward_model_off_every_rank(counts, capsys):
    c, frozen = counts
    run = lambda cfg: mem.plan(cfg, mem.PlanOptions(world_size=8), c, frozen)  # noqa: E731
    local, remote = run(_cfg()), run(_cfg(reward_model="remote", reward_url="http://rewardhost:8000"))
    model = frozen["reward"] * 2 / mem.GIB  # bf16 Qwen2-VL-2B + rm_head, on every rank when local
    assert local["terms_gib"]["reward model"] == pytest.approx(model) and 4 < model < 5
    assert remote["terms_gib"]["reward model"] == remote["terms_gib"]["reward forward (est)"] == 0
    for phase in local["phases_gib"]:  # every phase holds the model; decode+reward also its forward (or the decode)
        assert local["phases_gib"][phase] - remote["phases_gib"][phase] >= model - 1e-9
    saving = local["peak_gib"] - remote["peak_gib"]
    assert local["reward"]["peak_saving_gib"] == pytest.approx(saving) == remote["reward"]["peak_saving_gib"]
    assert (local["reward"]["remote"], remote["reward"]["remote"]) == (False, True)
    pm.main(["--config", str(ROOT / "configs/single_node_8gpu.yaml"), "--world_size", "8"])
    assert f"--reward_model remote (a reward server on other GPUs) lowers the peak by {saving:.1f} GiB per rank" in \
        capsys.readouterr().out


def test_lora_base_weights_encode_phase_and_weight_free_rewards(counts):
    """LoRA keeps the frozen base in the compute dtype; prompts are encoded before the policy loads (the encode phase
    holds the text encoders, not the policy); a weight-free reward holds no VideoAlign model."""
    c, frozen = counts
    cfg = _cfg(use_lora=True, enable_fsdp=False, sp_size=1, batch_size=4, master_weight_type="fp32", dtype="bf16",
               reward_model="brightness", reward_weights='{"brightness": 1.0}')
    lora_counts = mem.count_transformer(mem.build_transformer(mem.TRANSFORMER_CONFIGS["480p_t2v"]), use_lora=True)
    lora = mem.plan(cfg, mem.PlanOptions(world_size=1), lora_counts, frozen)
    t, ph = lora["terms_gib"], lora["phases_gib"]
    trainable = lora["params"]["trainable"]
    assert t["policy weights"] == pytest.approx(((c["total"]) * 2 + trainable * 4) / 2**30)  # bf16 base, fp32 LoRA
    assert t["reward model"] == 0 and t["reward forward (est)"] == 0
    enc = t["vae weights"] + t["text encoders before offload"] + t["text encoder forward (est)"] + t["overhead (est)"]
    assert ph["encode"] == pytest.approx(enc)  # no policy weights while the prompts are encoded
    assert ph["encode"] < ph["rollout"] - t["policy weights"] + t["text encoders before offload"] + 1e-9


# ------------------------------------------------------------------------------------------------ the FP8 base


def allocated_peak_bytes(fn) -> int:
    """The peak of the CPU allocator's bytes that `fn()` allocates on top of what was allocated before it ran: the
    allocator's records of torch.profiler (profile_memory: one record per allocation and per free, with its signed
    size and time) summed in time order. What max_memory_allocated gives on a GPU, on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak


def test_the_allocated_peak_sees_what_is_allocated():
    """The measuring method itself, on a known allocation: two live fp32 tensors of 1,000 and 500 elements, then
    one freed: a peak of 6,000 bytes (so the dequantization test below cannot pass on a method that sees nothing)."""
    def fn():
        a = torch.empty(1000)
        b = torch.empty(500)
        del a
        return b

    assert allocated_peak_bytes(fn) == 6000


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_fp8_dequantization_transient_is_what_torchao_allocates(dtype):
    """The planner's transient of a --fp8_base layer (`fp8_dequantize_bytes`, per weight element) equals what
    torchao's dequantize of one per-row FP8 layer (the project's Float8WeightOnlyConfig) allocates at its peak on the
    CPU, measured with the allocator's records: an fp32 copy and an fp32 product, plus the cast to bf16 (10 bytes
    per element; 8 in fp32), not the 2 bytes of one bf16 copy planned before (which fails here). The project's
    layer (FP8Linear) peaks at the same in its no-grad forward (the rollout's). A [6 x 64, 64] layer: the
    modulation's shape at a reduced width (the bytes per element do not depend on it)."""
    from torchao.quantization import quantize_

    from sage_grpo.models.fp8 import FP8Linear, quantized_config

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 6 * 64, dtype=dtype)
    fp8 = FP8Linear.from_linear(layer)
    quantize_(layer, quantized_config(False))  # torchao's own Float8Tensor weight
    n, e = layer.weight.numel(), torch.empty((), dtype=dtype).element_size()
    planned = mem.fp8_dequantize_bytes(e) * n
    assert allocated_peak_bytes(lambda: layer.weight.dequantize()) == planned
    assert planned == (10 if dtype == torch.bfloat16 else 8) * n
    x = torch.randn(4, 64, dtype=dtype)
    with torch.no_grad():
        # the output comes after the fp32 temporaries are freed, beside the dequantized weight only
        assert allocated_peak_bytes(lambda: fp8(x)) == planned


def _block_linears(model) -> tuple[int, int, int]:
    """(elements, output rows, the largest layer) of the transformer blocks' linear weights, counted here."""
    ws = [m.weight.shape for m in model.transformer_blocks.modules() if isinstance(m, torch.nn.Linear)]
    return sum(a * b for a, b in ws), sum(a for a, _ in ws), max(a * b for a, b in ws)


def test_the_plan_counts_one_byte_an_fp8_weight_and_its_dequantization(counts, lora_counts, monkeypatch):
    """The FP8 terms against an independent count of the blocks' linears (8.15B elements): the policy weights hold
    one byte per element plus an fp32 scale per output row, the bf16 rest and the fp32 adapters; FSDP2 gathers the
    same bytes; the transient is the largest linear (the 6D x D modulation, 25.2M elements at D 2048) at 10 bytes
    per element (0.234 GiB; torchao's peak with its own FP8 byte: 11, 0.258 GiB) and it is in the rollout, anchor
    and update phases, no other. Counting FP8 as half a byte, or dropping the transient, fails here."""
    c, frozen = counts
    elements, rows, largest = _block_linears(mem.build_transformer(mem.transformer_config("480p_t2v")))
    assert elements > 8.1e9 and largest == 6 * 2048 * 2048
    cfg = _cfg("configs/lora_24gb.yaml")
    pl = mem.plan(cfg, mem.PlanOptions(world_size=1, gpu_memory_gib=24), lora_counts, frozen)
    t, gib, trainable = pl["terms_gib"], mem.GIB, lora_counts["trainable"]
    assert t["policy weights"] * gib == pytest.approx((c["total"] - elements) * 2 + elements + 4 * rows + trainable * 4)
    assert t["fp8 weight dequantized (transient)"] * gib == largest * 10
    assert t["fp8 weight dequantized (transient)"] == pytest.approx(0.234, abs=5e-4)

    monkeypatch.setattr(mem, "fp8_dequantize_bytes", lambda e: 0)  # the same plan without the transient
    without = mem.plan(cfg, mem.PlanOptions(world_size=1, gpu_memory_gib=24), lora_counts, frozen)["phases_gib"]
    monkeypatch.undo()
    extra = {k: pl["phases_gib"][k] - without[k] for k in without}
    for phase, v in extra.items():
        want = t["fp8 weight dequantized (transient)"] if phase in ("rollout", "anchor", "update") else 0
        assert v == pytest.approx(want, abs=1e-9), phase

    # FSDP2 on 8 GPUs: a whole-model gather moves (7/8 of) the bf16 rest, one byte per FP8 element and the scales
    sharded = _cfg("configs/lora_24gb.yaml", enable_fsdp=True, batch_size=1)
    s = mem.plan(sharded, mem.PlanOptions(world_size=8), lora_counts, frozen)
    model = (c["total"] - elements) * 2 + elements + 4 * rows
    assert s["traffic"]["model_gather_gib"] * gib == pytest.approx(7 / 8 * model)
    assert s["terms_gib"]["policy weights"] * gib == pytest.approx((model + trainable * 4) / 8)


def test_the_planner_suggests_the_fp8_base(counts, lora_counts):
    """`configs/lora_24gb.yaml --fp8_base False` on 24 GiB (29.6 GiB planned): --fp8_base True alone fits (22.0
    GiB, the recipe's own plan) and is the whole suggestion, at 81 frames (it used to be --master_weight_type bf16
    --sample_n_frames 33). The README's one-GPU LoRA flags: --fp8_base first, and the plan fits at 81 frames. A full
    fine-tuning run is not offered it (--fp8_base needs --use_lora)."""
    from sage_grpo.config import load_config

    _, frozen = counts
    opts = mem.PlanOptions(world_size=1, gpu_memory_gib=24)
    recipe = ["--config", str(ROOT / "configs/lora_24gb.yaml")]
    bf16 = load_config([*recipe, "--fp8_base", "False"])
    assert mem.plan(bf16, opts, lora_counts, frozen)["peak_gib"] == pytest.approx(29.62, abs=0.01)
    ch = mem.fitting_changes(bf16, opts, lora_counts, frozen)
    fp8 = mem.plan(load_config(recipe), opts, lora_counts, frozen)["peak_gib"]
    assert [r["flags"] for r in ch["together"]] == ["--fp8_base True"] and ch["fits"]
    assert ch["together"][0]["peak_gib"] == pytest.approx(fp8) == pytest.approx(22.04, abs=0.01)
    assert "--fp8_base True" in [r["flags"] for r in ch["alone"] if r["fits"]]

    readme = load_config(["--use_lora", "True", "--master_weight_type", "bf16", "--enable_fsdp", "False",
                          "--batch_size", "4", "--num_generations", "4"])
    together = [r["flags"] for r in mem.fitting_changes(readme, opts, lora_counts, frozen)["together"]]
    assert together[0] == "--fp8_base True" and not any(f.startswith("--sample_n_frames") for f in together)
    assert all("--fp8_base" not in f for f, _ in mem.memory_changes(load_config([]), opts))  # full fine-tuning


def test_a_change_that_fits_alone_comes_first_and_the_fp8_base_first_of_those(counts, lora_counts, monkeypatch):
    """When several changes fit alone, the suggestion is one of them, the first in memory_changes' order (the FP8
    base, for a LoRA run), not the largest saving: here a smaller video size (an invented change, the largest
    saving) fits alone too and would come first by saving."""
    from sage_grpo.config import load_config

    _, frozen = counts
    opts = mem.PlanOptions(world_size=1, gpu_memory_gib=24)
    cfg = load_config(["--config", str(ROOT / "configs/lora_24gb.yaml"), "--fp8_base", "False"])
    real = mem.memory_changes

    def with_smaller_video(c, o):
        def apply(x):
            x.rollout.height, x.rollout.width = 96, 160
        return [*real(c, o), (["--height 96 --width 160"], apply)]

    monkeypatch.setattr(mem, "memory_changes", with_smaller_video)
    ch = mem.fitting_changes(cfg, opts, lora_counts, frozen)
    alone = {r["flags"]: r for r in ch["alone"]}
    assert alone["--height 96 --width 160"]["fits"] and alone["--fp8_base True"]["fits"]
    assert alone["--height 96 --width 160"]["saving_gib"] > alone["--fp8_base True"]["saving_gib"]
    assert [r["flags"] for r in ch["together"]] == ["--fp8_base True"]


# ------------------------------------------------------------------------------------------------ before a run


def test_the_device_check_decides_from_the_plan_and_the_gpus_memory(counts, lora_counts):
    """post_train's decision, a pure function of the config and a GPU's memory (no CUDA): the 24 GB recipe on its
    bf16 base does not fit 24 GiB (one line, with the planner's top suggestion), fits 32 GiB (nothing said); on 8 GiB
    nothing the planner knows fits (the line says so)."""
    from sage_grpo.config import load_config

    _, frozen = counts
    cfg = load_config(["--config", str(ROOT / "configs/lora_24gb.yaml"), "--fp8_base", "False"])
    line = mem.device_fit_line(cfg, 1, 24.0, counts=lora_counts, frozen=frozen)
    assert line.startswith("warning: memory plan: peak 29.6 GiB (decode+reward) does not fit this GPU's 24.0 GiB; "
                           "it fits with --fp8_base True (python scripts/plan_memory.py") and "\n" not in line
    assert mem.device_fit_line(cfg, 1, 32.0, counts=lora_counts, frozen=frozen) is None
    small = mem.device_fit_line(cfg, 1, 8.0, counts=lora_counts, frozen=frozen)
    assert "does not fit this GPU's 8.0 GiB; nothing the planner knows makes it fit" in small


@pytest.fixture()
def fake_gpu(monkeypatch):
    """post_train's preflight as on a CUDA GPU of 24 GiB (on this CPU): torch says there is one, and its memory."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"total_memory": 24 * 2**30})())
    monkeypatch.delenv("RANK", raising=False)


def _preflight_cfg(tiny_model, tmp_path):
    from post_train_helpers import _args

    from sage_grpo.config import load_config

    return load_config(_args(tiny_model, tmp_path / "run", "--use_lora"), prog="post_train.py")


def test_the_preflight_on_a_cpu_plans_nothing(tiny_model, tmp_path, monkeypatch, capsys):
    """A CPU run: the memory check is never run (it costs nothing)."""
    from post_train_helpers import pt

    def never(*a, **k):
        raise AssertionError("planned on a CPU run")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mem, "check_device_memory", never)
    pt.preflight(_preflight_cfg(tiny_model, tmp_path), 1)
    assert "memory plan" not in capsys.readouterr().out


def test_the_preflight_on_a_gpu_prints_the_decision_once(tiny_model, tmp_path, fake_gpu, counts, lora_counts,
                                                          monkeypatch, capsys):
    """On a (faked) 24 GiB GPU, a checkpoint of the real architecture (faked: the tiny one stands in for it) whose
    plan does not fit: preflight prints the decision's line once, from global rank 0 only."""
    from post_train_helpers import pt

    c, frozen = counts
    monkeypatch.setattr(mem, "checkpoint_plan_config", lambda cfg: mem.transformer_config("480p_t2v"))
    monkeypatch.setattr(mem, "build_transformer", lambda config: None)  # the fixtures' counts, counted once
    monkeypatch.setattr(mem, "count_transformer", lambda model, use_lora=False, **kw: lora_counts if use_lora else c)
    monkeypatch.setattr(mem, "count_frozen_parts", lambda: frozen)
    cfg = _preflight_cfg(tiny_model, tmp_path)
    pt.preflight(cfg, 1)
    lines = [x for x in capsys.readouterr().out.splitlines() if "memory plan" in x]
    assert lines == [mem.device_fit_line(cfg, 1, 24.0, counts=lora_counts, frozen=frozen)]
    assert lines[0].startswith("warning: memory plan: peak ") and "does not fit this GPU's 24.0 GiB" in lines[0]
    monkeypatch.setenv("RANK", "1")
    pt.preflight(cfg, 1)
    assert "memory plan" not in capsys.readouterr().out


def test_the_preflight_on_a_gpu_goes_on_when_the_planner_cannot_plan(tiny_model, tmp_path, fake_gpu, monkeypatch,
                                                                     capsys):
    """A model the planner does not count (the tiny checkpoint: another architecture), or a planner that fails:
    one line saying so, and the preflight goes on."""
    from post_train_helpers import pt

    cfg = _preflight_cfg(tiny_model, tmp_path)
    pt.preflight(cfg, 1)
    lines = [x for x in capsys.readouterr().out.splitlines() if "memory plan" in x]
    assert len(lines) == 1 and lines[0].startswith("memory plan: not planned (the transformer at ")
    assert "is not the real 480p_t2v architecture the planner counts (num_layers" in lines[0]
    assert lines[0].endswith("); going on")

    def broken(*a, **k):
        raise RuntimeError("the planner broke")

    monkeypatch.setattr(mem, "checkpoint_plan_config", lambda cfg: mem.transformer_config("480p_t2v"))
    monkeypatch.setattr(mem, "plan_run", broken)
    pt.preflight(cfg, 1)
    assert [x for x in capsys.readouterr().out.splitlines() if "memory plan" in x] == [
        "memory plan: not planned (the planner broke); going on"]
