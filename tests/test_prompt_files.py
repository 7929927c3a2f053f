"""Prompt files: every format strips its prompts the same way (the text cache keys and noise seeds depend on the
exact text), and an empty ref_image_path cell means no reference image."""

from sage_grpo.data import read_prompts


def test_csv_and_jsonl_prompts_are_stripped_like_txt(tmp_path):
    (tmp_path / "p.txt").write_text("  a cat walks \n\tsnow falls\t\n")
    (tmp_path / "p.csv").write_text('prompt,seed\n"  a cat walks ",1\n"\tsnow falls\t",2\n')
    (tmp_path / "p.jsonl").write_text('{"prompt": "  a cat walks "}\n{"prompt": "\\tsnow falls\\t"}\n')
    for name in ("p.txt", "p.csv", "p.jsonl"):
        assert [r.prompt for r in read_prompts(tmp_path / name)] == ["a cat walks", "snow falls"], name


def test_empty_ref_image_path_cell_is_none(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,ref_image_path\na cat,\na dog,imgs/dog.png\n")
    assert [r.ref_image_path for r in read_prompts(tmp_path / "p.csv")] == [None, "imgs/dog.png"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat", "ref_image_path": ""}\n{"prompt": "a dog"}\n')
    assert [r.ref_image_path for r in read_prompts(tmp_path / "p.jsonl")] == [None, None]
