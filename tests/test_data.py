"""Prompt files: csv / txt / jsonl and clear errors."""

import pytest

from sage_grpo.data import read_prompts
from sage_grpo.errors import SageGRPOError


def test_formats(tmp_path):
    (tmp_path / "p.csv").write_text('prompt,index,seed\n"a cat, walking",10,5\na dog,,\n')
    r = read_prompts(tmp_path / "p.csv")
    assert [(x.prompt, x.index, x.seed) for x in r] == [("a cat, walking", 10, 5), ("a dog", 1, None)]
    (tmp_path / "p.txt").write_text("one\n\n two \n")
    assert [(x.prompt, x.index) for x in read_prompts(tmp_path / "p.txt")] == [("one", 0), ("two", 1)]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "seed": 3}\n\n{"prompt": "b"}\n')
    assert [(x.prompt, x.seed) for x in read_prompts(tmp_path / "p.jsonl")] == [("a", 3), ("b", None)]


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("a.csv", "text\nhello\n", "`prompt` column"),
        ("b.csv", "prompt,seed\nhi,abc\n", "seed must be an integer"),
        ("c.csv", "prompt\n\"\"\n", "empty or missing prompt"),
        ("d.jsonl", "{bad json\n", "not valid JSON"),
        ("e.jsonl", '["a"]\n', "`prompt` field"),
        ("f.parquet", "x", "unsupported"),
        ("g.txt", "\n\n", "no prompts"),
    ],
)
def test_errors(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(SageGRPOError, match=match):
        read_prompts(tmp_path / name)
    with pytest.raises(SageGRPOError, match="not found"):
        read_prompts(tmp_path / "missing.csv")
