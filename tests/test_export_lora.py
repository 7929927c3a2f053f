"""scripts/export_checkpoint.py --lora_format on a LoRA checkpoint built here (train_state.json + lora/ of a tiny
transformer with a random adapter on every linear): each layout is written with its model card and loaded back
(through the loader generate.py uses, and by generate.py itself: the four exports give the same video), and the
user errors are one line before anything loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_grpo.config import Config, config_to_dict
from sage_grpo.errors import SageGRPOError
from sage_grpo.models.lora import adapter_parameters, lora_state_dict, save_lora, setup_trainable
from sage_grpo.models.lora_formats import FILE_NAMES, FORMATS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import export_checkpoint  # noqa: E402


def _transformer():
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.tiny import tiny_transformer_config

    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(**tiny_transformer_config()).eval()


def _adapted():
    tr = _transformer()
    targets = [n for n, m in tr.named_modules() if isinstance(m, torch.nn.Linear)]  # refiner q,k,v + norm_out too
    setup_trainable(tr, use_lora=True, lora_r=2, lora_alpha=3, lora_target_modules=targets)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in adapter_parameters(tr).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return tr


@pytest.fixture(scope="module")
def released_model(tmp_path_factory) -> Path:
    """A diffusers-layout folder whose transformer config.json is the released HunyuanVideo-1.5's (480p_t2v; the
    weights are a tiny model's: only the config is read for the model card)."""
    from sage_grpo.models.full_size import real_transformer_config
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    root = write_tiny_checkpoint(tmp_path_factory.mktemp("released") / "hv")
    config = json.loads((root / "transformer" / "config.json").read_text())
    config.update({k: list(v) if isinstance(v, tuple) else v for k, v in real_transformer_config("480p_t2v").items()})
    (root / "transformer" / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, released_model):
    """(checkpoint-7 of a LoRA run of the released model, the adapted transformer); metrics.jsonl with validation
    at steps 5 and 9."""
    run = tmp_path_factory.mktemp("run")
    ckpt = run / "checkpoint-7"
    ckpt.mkdir()
    tr = _adapted()
    save_lora(tr, ckpt / "lora")
    cfg = Config()
    cfg.model.use_lora, cfg.model.lora_r, cfg.model.lora_alpha = True, 2, 3
    cfg.optim.max_steps = 10
    cfg.model.model_path = str(released_model)
    (ckpt / "train_state.json").write_text(json.dumps({"step": 7, "config": config_to_dict(cfg)}))
    rows = [{"step": 5, "val/reward_total": 0.25, "val/videos": 4}, {"step": 7, "reward/total": 1.0},
            {"step": 9, "val/reward_total": 0.75}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, tr


@pytest.fixture(scope="module")
def exports(lora_run, tmp_path_factory):
    ckpt, _ = lora_run
    root = tmp_path_factory.mktemp("exports")
    return {fmt: export_checkpoint.main(["--checkpoint", str(ckpt), "--out", str(root / fmt), "--lora_format", fmt])
            for fmt in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_export_writes_the_layout_and_a_model_card(fmt, exports, lora_run):
    out = exports[fmt]
    assert (out / FILE_NAMES[fmt]).is_file()
    card = (out / "README.md").read_text()
    meta = card.split("---\n")[1]  # the YAML block the hub reads
    assert "base_model: " in meta and "- lora" in meta and "pipeline_tag: text-to-video" in meta
    assert ("base_model: tencent/HunyuanVideo-1.5" in meta) == (fmt in ("original", "comfy"))
    assert "Steps: 7 of 10" in card and "VQ 0.5, MQ 0.5, TA 1" in card and "LoRA: r 2, alpha 3" in card
    assert "At step 5" in card and "| val/reward_total | 0.25 |" in card and "0.75" not in card  # not after step 7
    assert "| `--sde_type` | sage_grpo |" in card
    how = {"diffusers": "load_lora_adapter", "peft": "PeftModel.from_pretrained", "comfy": "LoraLoaderModelOnly",
           "original": "--lora_format comfy"}[fmt]
    assert how in card and "generate.py" in card
    # loaded back through the loader of generate.py / --pretrained_lora_path (flags overridden by the file)
    dst = _transformer()
    setup_trainable(dst, use_lora=True, lora_r=1, lora_alpha=1, lora_target_modules=["to_q"],
                    pretrained_lora_path=str(out))
    got, want = lora_state_dict(dst), lora_state_dict(lora_run[1])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_generate_loads_every_exported_lora(exports, tiny_diffusers_dir, tmp_path):
    import generate
    from sage_grpo.video import read_video

    common = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size",
              "16x32", "--num_inference_steps", "2", "--prompt", "a red ball rolls"]
    [plain] = generate.main([*common, "--output_path", str(tmp_path / "plain.mp4")])
    videos = {}
    for fmt, out in exports.items():
        [path] = generate.main([*common, "--lora_path", str(out), "--output_path", str(tmp_path / f"{fmt}.mp4")])
        videos[fmt] = read_video(path)[0]
    assert not torch.equal(videos["peft"], read_video(plain)[0])  # the adapter changes the video
    assert all(torch.equal(v, videos["peft"]) for v in videos.values())  # and is the same adapter in every layout


def test_model_card_of_a_merged_export_and_without_metrics(tmp_path):
    from sage_grpo.models.model_card import model_card

    card = model_card(config_to_dict(Config()), step=3, kind="merged", files=["config.json"],
                      metrics_file=tmp_path / "none.jsonl")
    assert "base_model_relation: finetune" in card and "- lora" not in card
    assert "No validation metrics" in card and "from_pretrained" in card


def test_the_card_of_an_fp8_run_says_its_export_is_the_dequantized_fp8_base():
    """An --fp8_base run trained Q(W) + BA: the merged card says its weights are the FP8 base dequantized (merged, or
    the adapter beside them), an adapter's card that the unquantized base gives another model, and --fp8_matmul's
    activation quantization is named; a run without the FP8 base says none of it."""
    from sage_grpo.models.model_card import model_card

    cfg = config_to_dict(Config())
    cfg["model"].update(use_lora=True, fp8_base=True)
    merged = model_card(cfg, step=3, kind="merged", files=["config.json"])
    assert "These base weights are that FP8 base dequantized, with the adapter merged" in merged
    beside = model_card(cfg, step=3, kind="merged", files=["config.json", "lora/adapter_model.safetensors"])
    assert "the adapter beside them in `lora/`" in beside
    adapter = model_card(cfg, step=3, kind="comfy", files=["x.safetensors"])
    assert "On the unquantized base weights it gives another model" in adapter and "activations" not in adapter
    cfg["model"]["fp8_matmul"] = True
    assert "also quantized the activations per row" in model_card(cfg, step=3, kind="merged", files=["config.json"])
    cfg["model"]["fp8_base"] = False
    assert "FP8" not in model_card(cfg, step=3, kind="merged", files=["config.json"])


def test_model_card_of_an_i2v_run_names_the_i2v_pipeline_and_base(tmp_path):
    """A run's train_state.json "task" (post_train writes it) picks the tag, the pipeline class, the base repository
    (a diffusers-layout run keeps the default version 480p_t2v: the I2V one of that version is named) and --image."""
    from sage_grpo.models.model_card import model_card

    for kind in ("merged", "peft", "diffusers"):
        card = model_card(config_to_dict(Config()), step=3, kind=kind, files=["x.safetensors"], task="i2v",
                          lora_settings={"r": 4, "lora_alpha": 8, "target_modules": ["to_q"]})
        assert "pipeline_tag: image-to-video" in card and "- image-to-video" in card and "text-to-video" not in card
        assert "HunyuanVideo15ImageToVideoPipeline" in card and "HunyuanVideo15Pipeline." not in card
        assert "HunyuanVideo-1.5-Diffusers-480p_i2v" in card and ("--image " in card) == (kind != "merged")
    t2v = model_card(config_to_dict(Config()), step=3, kind="merged", files=["config.json"])
    assert "HunyuanVideo15Pipeline.from_pretrained" in t2v and "480p_t2v" in t2v and "--image" not in t2v


def test_the_card_of_another_model_than_the_released_one_names_its_folder_not_the_hub(lora_run, released_model,
                                                                                      tmp_path):
    """A run of a tiny model (or the world model) is not a fine-tune of the hub's HunyuanVideo-1.5: its card has no
    base_model, names the run's model folder and loads with generate.py --model_path; a model that cannot be found
    is not claimed either. The released architecture keeps the hub base (test_lora_export_writes_the_layout_...)."""
    from sage_grpo.models.model_card import released_base
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    tiny = write_tiny_checkpoint(tmp_path / "tiny" / "hv")
    config = json.loads((lora_run[0] / "train_state.json").read_text())["config"]
    assert released_base(config)
    assert not released_base({"model": {**config["model"], "model_path": str(tiny)}})
    assert not released_base({"model": {**config["model"], "model_path": str(tmp_path / "gone")}})
    ckpt = tmp_path / "run" / "checkpoint-7"
    shutil.copytree(lora_run[0], ckpt)
    config["model"]["model_path"] = str(tiny)
    (ckpt / "train_state.json").write_text(json.dumps({"step": 7, "config": config}))
    for fmt in ("peft", "comfy"):
        out = export_checkpoint.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / fmt), "--lora_format", fmt])
        card = (out / "README.md").read_text()
        meta = card.split("---\n")[1]
        assert "base_model" not in meta and "huggingface.co" not in card and "tencent/" not in card, card
        assert f"the model at `{tiny}`" in card and f"generate.py --model_path {tiny} --lora_path" in card
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] is None


def test_export_hides_the_libraries_warnings_unless_verbose(lora_run, tmp_path, monkeypatch):
    """As post_train.py and generate.py: the libraries' warnings (diffusers' "Guiders are experimental", the
    torchao import note) are silenced before anything loads; --verbose shows them."""
    calls = []
    monkeypatch.setattr(export_checkpoint, "quiet_libraries", calls.append)
    for i, extra in enumerate(([], ["--verbose"])):
        export_checkpoint.main(["--checkpoint", str(lora_run[0]), "--out", str(tmp_path / str(i)), "--lora_format",
                                "peft", *extra])
    assert calls == [False, True]


def test_lora_export_user_errors(lora_run, tmp_path):
    ckpt, _ = lora_run
    with pytest.raises(SageGRPOError, match="--lora_format 'kohya' is not one of peft, diffusers, original, comfy"):
        export_checkpoint.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "a"), "--lora_format", "kohya"])
    with pytest.raises(SageGRPOError, match="--merge_lora applies to the weights export"):
        export_checkpoint.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "a"), "--lora_format", "comfy",
                                "--merge_lora", "False"])
    full = tmp_path / "full" / "checkpoint-3"
    full.mkdir(parents=True)
    (full / "train_state.json").write_text(json.dumps({"step": 3, "config": config_to_dict(Config())}))
    with pytest.raises(SageGRPOError, match="is a full fine-tuning checkpoint \\(no lora/ adapter\\)"):
        export_checkpoint.main(["--checkpoint", str(full), "--out", str(tmp_path / "b"), "--lora_format", "comfy"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_lora_export_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts/export_checkpoint.py"), "--checkpoint", str(tmp_path),
                        "--out", str(tmp_path / "o"), "--lora_format", "kohya"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("error: --lora_format 'kohya' is not one of")


def test_an_adapter_of_another_base_is_one_line_naming_both_shapes(tiny_diffusers_dir, tmp_path, capsys):
    """A LoRA run on a wider model (mlp_ratio 4: same keys, other shapes) into the tiny one, by generate.py
    --lora_path of its export, --checkpoint_path of the run (merged into the named base) and the FSDP2 loader: one
    line naming both shapes, exit 2 (not torch's size-mismatch report and a traceback)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from helpers import lora_checkpoint

    import generate
    from sage_grpo.errors import run_cli
    from sage_grpo.models.lora import load_lora_sharded
    from sage_grpo.models.tiny import tiny_transformer_config

    torch.manual_seed(0)
    wide = HunyuanVideo15Transformer3DModel(**{**tiny_transformer_config(), "mlp_ratio": 4.0})
    ckpt = lora_checkpoint(tmp_path / "run", None, transformer=wide)
    peft = export_checkpoint.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "peft"), "--lora_format", "peft"])
    capsys.readouterr()
    shapes = (r"does not fit the model: 4 weights of another shape, e.g. "
              r"transformer_blocks.0.ff.net.0.proj.lora_B.weight is \[256, 2\] in the adapter but \[128, 2\] in the "
              r"model; it was trained on another base model")
    common = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size",
              "16x32", "--num_inference_steps", "2", "--prompt", "x", "--output_path", str(tmp_path / "o")]
    for more in (["--lora_path", str(peft)], ["--checkpoint_path", str(ckpt)]):
        with pytest.raises(SystemExit) as e:
            run_cli(generate.main, [*common, *more])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and re.search(shapes, err), err
    tiny = _transformer()
    setup_trainable(tiny, use_lora=True, lora_r=2, lora_alpha=2)
    with pytest.raises(SageGRPOError, match=shapes):
        load_lora_sharded(tiny, peft)
