"""A synthetic video world: seeded clips of simple shapes with captions, and detectors that read them back.

Captions name what is checkable ("a small red circle moves right on a blue background"); `render` draws them,
`detect` reads colour, shape, size and motion back from pixels (exact on rendered clips), and the world rewards
(`sage_grpo.rewards.world`) and held-out metrics (`sage_grpo.world.metrics`) score videos with those detectors.
"""

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
from sage_grpo.world.detectors import DetectedObject, Detection, detect, detect_batch, detected_attributes
from sage_grpo.world.render import DEFAULT_FRAMES, DEFAULT_SIZE, Scene, layout, render, render_caption
from sage_grpo.world.sampler import (
    HELDOUT_PAIRS,
    WorldClip,
    is_heldout,
    iter_clips,
    sample_clip,
    single_object_attributes,
    world_captions,
)

__all__ = [
    "COLORS",
    "MOTIONS",
    "SHAPES",
    "SIZES",
    "Attributes",
    "ObjectAttrs",
    "make_caption",
    "parse_caption",
    "Detection",
    "DetectedObject",
    "detect",
    "detect_batch",
    "detected_attributes",
    "DEFAULT_FRAMES",
    "DEFAULT_SIZE",
    "Scene",
    "layout",
    "render",
    "render_caption",
    "HELDOUT_PAIRS",
    "WorldClip",
    "is_heldout",
    "iter_clips",
    "sample_clip",
    "single_object_attributes",
    "world_captions",
]
