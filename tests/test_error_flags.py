"""Every `--flag` an error or hint names exists on the command that prints it: the user-error strings (the
arguments of SageGRPOError, `.error(...)`, warnings, and strings assigned to a `*hint*` name) of each entry point and
of the modules whose errors reach it, scanned from the source and checked against that command's parser. A flag
after another command in the same string (`python scripts/x.py --out`, `hf download --include`, `torchrun ...`) is
that command's (up to the next `)` or `;`) and is not checked."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*[a-z0-9])(?![\w-])")
OTHER_COMMAND = re.compile(r"python\S* \S+\.py|\bhf (download|auth)|\btorchrun\b|\bpip install\b|\bsbatch\b")
CALLS = {"SageGRPOError", "error", "warn", "warning"}

REWARD_MODULES = ["sage_grpo/rewards/videoalign.py", "sage_grpo/rewards/videoalign_ckpt.py",
                  "sage_grpo/rewards/clip_metrics.py"]
# command -> the files whose user errors it prints (its own first)
COMMANDS = {
    "post_train.py": ["post_train.py", "sage_grpo/checkpoint.py", "sage_grpo/models/image_cond.py",
                      "sage_grpo/models/loading.py", *REWARD_MODULES],
    "generate.py": ["generate.py", "sage_grpo/models/image_cond.py", "sage_grpo/models/loading.py"],
    "scripts/serve_reward.py": ["scripts/serve_reward.py", *REWARD_MODULES],
    "scripts/export_checkpoint.py": ["scripts/export_checkpoint.py"],
    "scripts/score_videos.py": ["scripts/score_videos.py", "sage_grpo/rewards/clip_metrics.py"],
}


def named_flags(path: Path) -> dict[str, int]:
    """flag name -> first line where a user-error or hint string of `path` names it."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        values = []
        if isinstance(node, ast.Call):
            f = node.func
            if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "") in CALLS:
                values = [*node.args, *(k.value for k in node.keywords)]
        elif isinstance(node, ast.Assign) and any("hint" in ast.unparse(t).lower() for t in node.targets):
            values = [node.value]
        for value in values:
            # str(err).replace("--reward_model", "--metrics"): a translation, the message names the second
            renamed = {id(a) for n in ast.walk(value) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                       and n.func.attr == "replace" for a in n.args[:1]}
            for n in ast.walk(value):
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in renamed:
                    text = re.sub(f"({OTHER_COMMAND.pattern})[^);]*", "", n.value)  # up to its ) or ;
                    for m in FLAG.finditer(text):
                        found.setdefault(m[1], n.lineno)
    return found


def _load(rel: str):
    name = Path(rel).stem
    spec = importlib.util.spec_from_file_location(f"_flags_{name}", ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def parser_flags(command: str) -> set[str]:
    if command == "post_train.py":
        from sage_grpo.config import build_parser

        parser = build_parser()
    elif command in ("generate.py", "scripts/serve_reward.py"):
        parser = _load(command).build_parser()
    else:  # the parser the script's main builds, caught when it parses
        import argparse

        class Built(Exception):
            pass

        def catch(self, *args, **kwargs):
            raise Built(self)

        module = _load(command)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(argparse.ArgumentParser, "parse_args", catch)
            mp.setattr(argparse.ArgumentParser, "parse_known_args", catch)
            with pytest.raises(Built) as built:
                (module.parse_args if hasattr(module, "parse_args") else module.main)([])
        parser = built.value.args[0]
    return {f[2:] for a in parser._actions for f in a.option_strings if f.startswith("--")}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_an_error_names_exists_on_its_command(command):
    flags = parser_flags(command)
    serve = _load("scripts/serve_reward.py") if command == "scripts/serve_reward.py" else None
    wrong = []
    for rel in COMMANDS[command]:
        for flag, line in named_flags(ROOT / rel).items():
            shown = flag
            if serve is not None and rel != command:  # serve_reward.py says a reward's errors in its own flags
                shown = serve.own_flags(f"--{flag}")[2:]
            if shown not in flags:
                wrong.append(f"{rel}:{line}: --{shown}")
    assert not wrong, f"{command} has no such flag: " + ", ".join(wrong)


def test_the_scan_finds_a_flag_in_an_error_and_in_a_hint(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('hint = "or set --alpha"\n'
                   'def f():\n    raise SageGRPOError(f"bad --beta {1} (python scripts/x.py --gamma) or --delta")\n')
    assert set(named_flags(src)) == {"alpha", "beta", "delta"}


def test_serve_reward_says_a_rewards_error_in_its_own_flags():
    serve = _load("scripts/serve_reward.py")
    assert (serve.own_flags("point --reward_model_path at it, or --reward_base_model_path; --reward_model x")
            == "point --model_path at it, or --base_model_path; --reward_model x")


def test_export_of_a_path_that_does_not_exist_says_so(tmp_path):
    from sage_grpo.errors import SageGRPOError

    export = _load("scripts/export_checkpoint.py")
    with pytest.raises(SageGRPOError, match=r"--checkpoint '.*nope' does not exist"):
        export.main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_exported_folder_names_its_base_for_generate(tmp_path):
    """generate.py --checkpoint_path <exported folder> without a base takes the one its model card names."""
    from sage_grpo.models.model_card import card_base, model_card

    cfg = {"model": {"pretrained_transformer_version": "720p_t2v", "model_path": "elsewhere/hv"}, "optim": {}}
    (tmp_path / "README.md").write_text(model_card(cfg, step=1, kind="merged", files=[], released=True))
    assert card_base(tmp_path) == {"pretrained_transformer_version": "720p_t2v"}
    (tmp_path / "README.md").write_text(model_card(cfg, step=1, kind="merged", files=[], released=False))
    assert card_base(tmp_path) == {"model_path": "elsewhere/hv"}
    assert card_base(tmp_path / "none") == {}
