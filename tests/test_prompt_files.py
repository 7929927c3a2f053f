"""Prompt files: every format strips its prompts the same way (the text cache keys and noise seeds depend on the
exact text), an empty ref_image_path cell means no reference image, a path is relative to the prompt file, and a
file holds one task."""

import pytest

from sage_grpo.data import read_prompts
from sage_grpo.errors import SageGRPOError


def test_csv_and_jsonl_prompts_are_stripped_like_txt(tmp_path):
    (tmp_path / "p.txt").write_text("  a cat walks \n\tsnow falls\t\n")
    (tmp_path / "p.csv").write_text('prompt,seed\n"  a cat walks ",1\n"\tsnow falls\t",2\n')
    (tmp_path / "p.jsonl").write_text('{"prompt": "  a cat walks "}\n{"prompt": "\\tsnow falls\\t"}\n')
    for name in ("p.txt", "p.csv", "p.jsonl"):
        assert [r.prompt for r in read_prompts(tmp_path / name)] == ["a cat walks", "snow falls"], name


def test_empty_ref_image_path_cell_is_none(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,ref_image_path\na cat,\na dog,\n")
    assert [r.ref_image_path for r in read_prompts(tmp_path / "p.csv")] == [None, None]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat", "ref_image_path": ""}\n{"prompt": "a dog"}\n')
    assert [r.ref_image_path for r in read_prompts(tmp_path / "p.jsonl")] == [None, None]


def test_ref_image_paths_are_relative_to_the_prompt_file(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)  # elsewhere than the prompt file: the path must not depend on the working directory
    absolute = str(tmp_path / "elsewhere" / "x.png")
    (tmp_path / "data/p.csv").write_text(f"prompt,ref_image_path\na cat,imgs/cat.png\na dog,{absolute}\n")
    (tmp_path / "data/p.jsonl").write_text('{"prompt": "a cat", "ref_image_path": "imgs/cat.png"}\n'
                                           f'{{"prompt": "a dog", "ref_image_path": "{absolute}"}}\n')
    for name in ("p.csv", "p.jsonl"):
        recs = read_prompts(f"data/{name}")
        assert [r.ref_image_path for r in recs] == [str(tmp_path / "data/imgs/cat.png"), absolute], name


def test_a_prompt_file_mixing_tasks_is_one_error(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,ref_image_path\na cat,cat.png\na dog,\n")
    with pytest.raises(SageGRPOError, match=r"mixes tasks: 1 prompts have a ref_image_path .* the first is prompt 2"):
        read_prompts(tmp_path / "p.csv")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat", "ref_image_path": 3}\n')
    with pytest.raises(SageGRPOError, match="ref_image_path must be a path"):
        read_prompts(tmp_path / "p.jsonl")
