"""sage_grpo.video: the one mp4 module (write, read, ffmpeg check) and the prompt file beside a video."""

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.video import check_mp4_support, read_prompt_file, read_video, write_prompt_file, write_video


def test_lossless_roundtrip_is_exact(tmp_path):
    frames = torch.rand(5, 3, 16, 24, generator=torch.Generator().manual_seed(0))
    write_video(tmp_path / "v.mp4", frames, fps=10, lossless=True)
    back, fps = read_video(tmp_path / "v.mp4")
    assert fps == 10 and torch.equal(back, (frames * 255).round() / 255)


def test_unreadable_video_is_one_line_without_the_ffmpeg_banner(tmp_path):
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    with pytest.raises(SageGRPOError) as info:
        read_video(tmp_path / "bad.mp4")
    msg = str(info.value)
    assert msg.startswith("cannot decode video "
                          f"{tmp_path / 'bad.mp4'}") and "\n" not in msg and "ffmpeg version" not in msg


def test_ffmpeg_is_found():
    assert check_mp4_support()


def test_prompt_file(tmp_path):
    v = tmp_path / "a.mp4"
    assert read_prompt_file(v) is None
    write_prompt_file(v, "line one\nline two  ")
    assert read_prompt_file(v) == "line one\nline two  "
    (tmp_path / "a.txt").write_bytes(b"windows prompt\r\n")
    assert read_prompt_file(v) == "windows prompt"
    (tmp_path / "a.txt").write_text("   \n")
    assert read_prompt_file(v) is None


def test_an_interrupted_write_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch):
    import imageio.v2 as imageio

    from sage_grpo.video import read_video, write_text_atomic, write_video

    path = tmp_path / "v.mp4"
    old = torch.zeros(3, 3, 16, 16)
    write_video(path, old, fps=8)
    real = imageio.get_writer

    def dying_writer(*a, **k):
        w = real(*a, **k)

        def append(frame):
            raise KeyboardInterrupt  # Ctrl-C half-way through the frames

        w.append_data = append
        return w

    monkeypatch.setattr(imageio, "get_writer", dying_writer)
    with pytest.raises(KeyboardInterrupt):
        write_video(path, torch.ones(3, 3, 16, 16), fps=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]
    frames, _ = read_video(path)
    assert float(frames.max()) < 0.1  # still the old (black) video

    monkeypatch.setattr(type(path), "write_text", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space")))
    (tmp_path / "p.txt").write_bytes(b"old\n")
    with pytest.raises(OSError):
        write_text_atomic(tmp_path / "p.txt", "new\n")
    assert (tmp_path / "p.txt").read_bytes() == b"old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "v.mp4"]
