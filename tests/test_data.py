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
        ("h.csv", "", "empty file"),
        ("i.jsonl", "\n", "no prompts"),
        ("j.txt", b"\xff\xfe a cat", "not UTF-8 text .byte 0.; save the prompt file as UTF-8"),
        ("k.csv", b"prompt\n\x80\n", "not UTF-8 text"),
    ],
)
def test_errors(tmp_path, name, text, match):
    if isinstance(text, bytes):
        (tmp_path / name).write_bytes(text)
    else:
        (tmp_path / name).write_text(text)
    with pytest.raises(SageGRPOError, match=match):
        read_prompts(tmp_path / name)
    with pytest.raises(SageGRPOError, match="not found"):
        read_prompts(tmp_path / "missing.csv")
    (tmp_path / "folder.txt").mkdir()
    with pytest.raises(SageGRPOError, match="is a folder"):
        read_prompts(tmp_path / "folder.txt")


def test_group_sampler_layout_epochs_and_resume():
    from sage_grpo.data import GroupSampler

    s = GroupSampler(5, batch_size=2, num_generations=4, dp_size=4, seed=1)  # 8 videos = 2 prompts per step
    steps = [s.next_step() for _ in range(5)]  # 10 prompts = exactly 2 epochs
    assert all(len(x) == 2 for x in steps)
    flat = [p for x in steps for p in x]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:]) == list(range(5))  # each epoch a permutation
    assert flat[:5] != flat[5:]  # reshuffled per epoch (seed + epoch)
    assert s.state_dict() == {"epoch": 2, "position": 0}
    # a group of 4 spans ranks 0-1 and 2-3; every rank holds batch_size videos; generations run 0..G-1
    layout = [s.rank_slice([7, 9], r) for r in range(4)]
    assert layout == [[(0, 7, 0), (0, 7, 1)], [(0, 7, 2), (0, 7, 3)], [(1, 9, 0), (1, 9, 1)], [(1, 9, 2), (1, 9, 3)]]
    # resume: a fresh sampler restored from the state continues identically
    a = GroupSampler(5, batch_size=2, num_generations=4, dp_size=4, seed=1)
    a.next_step(), a.next_step(), a.next_step()  # position 1 of epoch 1: the next step crosses no boundary yet
    b = GroupSampler(5, batch_size=2, num_generations=4, dp_size=4, seed=1)
    b.load_state_dict(a.state_dict())
    assert [a.next_step() for _ in range(4)] == [b.next_step() for _ in range(4)]
    c = GroupSampler(5, batch_size=2, num_generations=4, dp_size=4, seed=2)
    assert [c.next_step() for _ in range(3)] != steps[:3]


def test_group_sampler_draws_each_step_from_one_size_bucket():
    """Image-to-video prompts of several sizes: every step's prompts share one bucket, bucket b is drawn with
    probability n_b / N from (seed, step) (the same on ranks that compute the plan alone), each bucket visits its
    prompts once per epoch of its own, a restored state continues identically; one bucket draws what no buckets
    draw."""
    from collections import Counter

    import torch

    from sage_grpo.data import GroupSampler
    from sage_grpo.seeding import derive_seed

    keys = ["wide"] * 6 + ["square"] * 2 + ["wide", "tall"]  # 7 : 2 : 1, interleaved in the file
    bucket = {i: k for i, k in enumerate(keys)}

    def make(**kw):
        return GroupSampler(10, **{"batch_size": 4, "num_generations": 2, "dp_size": 1, "seed": 5, **kw},
                            buckets=keys)

    s = make()
    steps = [s.next_step() for _ in range(2000)]
    for i, x in enumerate(steps):
        assert len(x) == 2 and len({bucket[p] for p in x}) == 1, f"step {i} mixes sizes: {x}"
    drawn = Counter(bucket[x[0]] for x in steps)
    for key, share in (("wide", 0.7), ("square", 0.2), ("tall", 0.1)):  # 3 binomial standard deviations or less
        assert abs(drawn[key] / 2000 - share) < 3 * (share * (1 - share) / 2000) ** 0.5, (key, drawn)
    square = [p for x in steps if bucket[x[0]] == "square" for p in x]
    assert all(sorted(square[i : i + 2]) == [6, 7] for i in range(0, 20, 2))  # an epoch of its own per bucket
    wide = [p for x in steps if bucket[x[0]] == "wide" for p in x][:35]
    epochs = [wide[i : i + 7] for i in range(0, 35, 7)]
    assert all(sorted(e) == [0, 1, 2, 3, 4, 5, 8] for e in epochs) and epochs[0] != epochs[1]
    # two data-parallel ranks, each alone, draw the one-process plan (and the same bucket) at every step
    ranks, one = [make(batch_size=2, dp_size=2) for _ in range(2)], make()
    for _ in range(20):
        prompts = one.next_step()
        assert [r.next_step() for r in ranks] == [prompts, prompts]
    # resume: a fresh sampler restored from the state continues identically
    a, b = make(), make()
    for _ in range(7):
        a.next_step()
    b.load_state_dict(a.state_dict())
    assert [a.next_step() for _ in range(30)] == [b.next_step() for _ in range(30)]
    with pytest.raises(SageGRPOError, match="has 1 size bucket"):
        b.load_state_dict({"epoch": 0, "position": 0})  # a checkpoint of a one-size run
    # one bucket: the unbucketed draw, state and all
    plain, one_key = (GroupSampler(5, batch_size=2, num_generations=4, dp_size=4, seed=1, buckets=bk)
                      for bk in (None, ["k"] * 5))
    drawn = [plain.next_step() for _ in range(7)]
    assert drawn == [one_key.next_step() for _ in range(7)]
    assert plain.state_dict() == one_key.state_dict() == {"epoch": 2, "position": 4}
    perms = [torch.randperm(5, generator=torch.Generator().manual_seed(derive_seed(1, e, 0x5A4D))).tolist()
             for e in range(3)]  # the unbucketed rule, written out: a permutation per epoch from (seed, epoch)
    assert sum(drawn, []) == sum(perms, [])[:14]


def test_an_unreadable_prompt_file_is_one_message(tmp_path, monkeypatch):
    """Permissions cannot be taken away from root (CI), so the read itself fails as it would without them."""
    import errno
    import os
    from pathlib import Path

    p = tmp_path / "p.txt"
    p.write_text("a cat\n")

    def denied(self, *a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(SageGRPOError, match=r"p.txt cannot be read \(Permission denied\)"):
        read_prompts(p)
