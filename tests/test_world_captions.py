"""World captions: every attribute set round-trips through its caption; anything else fails with one clear line."""

from __future__ import annotations

import itertools

import pytest

from sage_grpo.errors import SageGRPOError
from sage_grpo.world.captions import (
    COLORS,
    MOTIONS,
    SHAPES,
    SIZES,
    Attributes,
    ObjectAttrs,
    make_caption,
    parse_caption,
)


def test_caption_text_of_one_and_two_objects():
    """The caption reads as English with the verb agreeing with the number of objects."""
    one = Attributes((ObjectAttrs("small", "red", "circle"),), "right", "blue")
    assert make_caption(one) == "a small red circle moves right on a blue background"
    two = Attributes((ObjectAttrs("large", "green", "square"), ObjectAttrs("small", "white", "triangle")), "bounces",
                     "black")
    assert make_caption(two) == "a large green square and a small white triangle bounce on a black background"


def test_every_single_object_caption_round_trips():
    """parse_caption inverts make_caption on the whole one-object vocabulary (1,260 captions)."""
    n = 0
    for size, color, shape, motion, bg in itertools.product(SIZES, COLORS, SHAPES, MOTIONS, COLORS):
        if bg == color:
            continue
        attrs = Attributes((ObjectAttrs(size, color, shape),), motion, bg)
        text = make_caption(attrs)
        assert parse_caption(text) == attrs
        n += 1
    assert n == len(SIZES) * len(COLORS) * len(SHAPES) * len(MOTIONS) * (len(COLORS) - 1)


def test_two_object_captions_round_trip():
    """Two-object captions round-trip for every motion and colour order."""
    for motion, (c1, c2, bg) in itertools.product(MOTIONS, itertools.permutations(list(COLORS)[:4], 3)):
        attrs = Attributes((ObjectAttrs("small", c1, "triangle"), ObjectAttrs("large", c2, "circle")), motion, bg)
        assert parse_caption(make_caption(attrs)) == attrs


def test_parse_is_lenient_about_case_spaces_and_full_stop():
    """Case, repeated spaces and a final full stop do not matter."""
    assert parse_caption("  A Small RED circle  moves right on a blue background. ") == parse_caption(
        "a small red circle moves right on a blue background"
    )


@pytest.mark.parametrize(
    "text, match",
    [
        ("a red ball rolls across the grass", "cannot parse world caption 'a red ball rolls.*write it as"),
        ("a small pink circle moves right on a blue background", "cannot parse.*colours: red, yellow"),
        ("a small red circle move right on a blue background", "verb is 'moves', not 'move'"),
        ("a small red circle and a large blue square bounces on a white background", "verb is 'bounce'"),
        ("a small red circle moves right on a red background", "cannot draw world caption.*must all differ"),
        ("", "cannot parse world caption ''"),
    ],
)
def test_unparseable_captions_fail_with_one_line(text, match):
    """Each bad caption is a SageGRPOError of one line that says what the world expects."""
    with pytest.raises(SageGRPOError, match=match) as info:
        parse_caption(text)
    assert "\n" not in str(info.value)


def test_long_caption_is_shortened_in_the_error():
    """A huge prompt does not flood the error line."""
    with pytest.raises(SageGRPOError) as info:
        parse_caption("x" * 5000)
    assert len(str(info.value)) < 600


def test_attributes_reject_what_the_world_cannot_draw():
    """Unknown words, three objects and repeated colours are refused with the valid choices named."""
    obj = ObjectAttrs("small", "red", "circle")
    with pytest.raises(SageGRPOError, match="unknown shape 'hexagon'.*circle, square, triangle"):
        Attributes((ObjectAttrs("small", "red", "hexagon"),), "left", "blue")
    with pytest.raises(SageGRPOError, match="unknown motion 'spins'"):
        Attributes((obj,), "spins", "blue")
    with pytest.raises(SageGRPOError, match="1 or 2 objects"):
        three = (obj, ObjectAttrs("small", "blue", "circle"), ObjectAttrs("small", "green", "circle"))
        Attributes(three, "up", "white")
    with pytest.raises(SageGRPOError, match="must all differ"):
        Attributes((obj, ObjectAttrs("large", "red", "square")), "up", "white")
