"""The world's vocabulary, its attribute records, and captions to and from attributes.

A caption names everything a person (and the detectors) can check in a clip, and nothing else: the objects' size,
colour and shape, their common motion, and the background colour. Positions and speeds are not in the caption; the
renderer draws them from the seed. Grammar (lower case, a final full stop allowed)::

    a <size> <colour> <shape> <moves left|right|up|down | bounces> on a <colour> background
    a <size> <colour> <shape> and a <size> <colour> <shape> <move left|... | bounce> on a <colour> background

Colours within one caption are all different (object from object and from the background): the detectors tell the
objects apart by colour, so a caption with a repeated colour is not one the world can draw.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sage_grpo.errors import SageGRPOError

__all__ = [
    "COLORS",
    "SHAPES",
    "SIZES",
    "MOTIONS",
    "ObjectAttrs",
    "Attributes",
    "make_caption",
    "parse_caption",
]

# Named colours, RGB in [0, 1]: pairwise >= 0.55 apart (Euclidean), so a pixel's nearest name survives noise and
# codec error; no 30/50/70% mix of two of them lies within 0.37 of a third, so a blurred edge between two colours
# does not read as a third (purple, the mix of red and blue, is left out for that reason); and none is the mid-grey
# that a blurry or untrained model drifts to.
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "yellow": (0.95, 0.85, 0.10),
    "green": (0.10, 0.70, 0.20),
    "cyan": (0.10, 0.80, 0.85),
    "blue": (0.10, 0.25, 0.90),
    "white": (0.95, 0.95, 0.95),
    "black": (0.05, 0.05, 0.05),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: tuple[str, ...] = ("small", "large")
# straight-line motions and "bounces" (out to a wall and back along one axis)
MOTIONS: tuple[str, ...] = ("left", "right", "up", "down", "bounces")


@dataclass(frozen=True)
class ObjectAttrs:
    """One object as a caption names it."""

    size: str  # one of SIZES
    color: str  # one of COLORS
    shape: str  # one of SHAPES


@dataclass(frozen=True)
class Attributes:
    """Everything a caption says about a clip: one or two objects sharing one motion, on a plain background."""

    objects: tuple[ObjectAttrs, ...]
    motion: str  # one of MOTIONS
    background: str  # one of COLORS

    def __post_init__(self) -> None:
        """Reject attribute sets the world cannot draw (one clear line naming what to change)."""
        if not 1 <= len(self.objects) <= 2:
            raise SageGRPOError(f"a world clip has 1 or 2 objects, got {len(self.objects)}")
        for o in self.objects:
            _check_word("size", o.size, SIZES)
            _check_word("colour", o.color, tuple(COLORS))
            _check_word("shape", o.shape, SHAPES)
        _check_word("motion", self.motion, MOTIONS)
        _check_word("background colour", self.background, tuple(COLORS))
        colors = [o.color for o in self.objects] + [self.background]
        if len(set(colors)) != len(colors):
            raise SageGRPOError(
                f"colours in a world clip must all differ (objects and background), got {', '.join(colors)}"
            )


def _check_word(what: str, word: str, valid: tuple[str, ...]) -> None:
    if word not in valid:
        raise SageGRPOError(f"unknown {what} {word!r}; the world knows: {', '.join(valid)}")


def _object_phrase(o: ObjectAttrs) -> str:
    return f"a {o.size} {o.color} {o.shape}"


def make_caption(attrs: Attributes) -> str:
    """The caption of ``attrs``, e.g. "a small red circle moves right on a blue background"."""
    two = len(attrs.objects) == 2
    subject = " and ".join(_object_phrase(o) for o in attrs.objects)
    if attrs.motion == "bounces":
        verb = "bounce" if two else "bounces"
    else:
        verb = f"{'move' if two else 'moves'} {attrs.motion}"
    return f"{subject} {verb} on a {attrs.background} background"


_WORD = {
    "size": "|".join(SIZES),
    "color": "|".join(COLORS),
    "shape": "|".join(SHAPES),
    "dir": "left|right|up|down",
}
_OBJ = r"an? ({size}) ({color}) ({shape})".format(**_WORD)
_PATTERN = re.compile(
    rf"^{_OBJ}(?: and {_OBJ})? (?:(moves?) ({_WORD['dir']})|(bounces?)) on an? ({_WORD['color']}) background$"
)
_GRAMMAR = (
    '"a <small|large> <colour> <circle|square|triangle> [and a <size> <colour> <shape>] '
    '<moves left|right|up|down|bounces> on a <colour> background"'
)


def parse_caption(text: str) -> Attributes:
    """Attributes of a world caption (case-insensitive; extra spaces and final full stops ignored).

    Raises SageGRPOError with one line saying what the world expects when ``text`` is not a world caption.
    """
    shown = repr(text if len(str(text)) <= 120 else str(text)[:117] + "...")
    norm = " ".join(str(text).strip().lower().rstrip(".").split())
    m = _PATTERN.match(norm)
    if m is None:
        raise SageGRPOError(
            f"cannot parse world caption {shown}: write it as {_GRAMMAR} (colours: {', '.join(COLORS)})"
        )
    s1, c1, h1, s2, c2, h2, move_verb, direction, bounce_verb, bg = m.groups()
    objects = [ObjectAttrs(s1, c1, h1)]
    if s2 is not None:
        objects.append(ObjectAttrs(s2, c2, h2))
    two = len(objects) == 2
    # the verb agrees with the number of objects, so that make_caption(parse_caption(t)) == t for a valid t
    if direction:
        verb, expected = move_verb, "move" if two else "moves"
    else:
        verb, expected = bounce_verb, "bounce" if two else "bounces"
    if verb != expected:
        raise SageGRPOError(
            f"cannot parse world caption {shown}: with {len(objects)} object(s) the verb is {expected!r}, not {verb!r}"
        )
    try:
        return Attributes(tuple(objects), direction or "bounces", bg)
    except SageGRPOError as err:  # e.g. a repeated colour: say which caption
        raise SageGRPOError(f"cannot draw world caption {shown}: {err}") from None
