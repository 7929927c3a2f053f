"""Detectors that read a clip's attributes back from its pixels: background and object colours, shape, size,
centroid track and motion direction.

They are exact on rendered clips and meant to hold up on noisy, blurry or generated ones. How:

* background = the per-channel median over all pixels of all frames (objects cover well under half a frame);
* foreground = pixels more than `FG_DIST` from it, split per frame into 8-connected components; a component's
  colour is the median of its core pixels (those at least 70% as far from the background as its farthest pixel),
  so blurred edges, which mix object and background, never decide a colour;
* an object = the largest component of one named colour in each frame (the world's colours within a clip differ);
  its soft mask is each pixel's coverage along the line from the background colour to the object colour (1 = the
  object colour, 0.5 = the shape's edge), within the component grown by a pixel;
* shape = the template (circle, square, triangle) with the best soft IoU when fitted to the mask's first and second
  moments (sub-pixel exact on anti-aliased renders, and a blur barely moves moments), median over frames; size = the
  fitted box side against the midpoint of the small and large sides; motion = from the coverage-weighted centroid
  track: still, a straight line (sign of the net displacement on the axis of largest excursion) or a bounce (net
  displacement under `BOUNCE_RATIO` of the excursion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sage_grpo.errors import SageGRPOError
from sage_grpo.world.captions import COLORS, SHAPES, Attributes, ObjectAttrs
from sage_grpo.world.render import RADIUS_FRAC, shape_coverage

__all__ = [
    "FG_DIST",
    "DetectedObject",
    "Detection",
    "palette",
    "nearest_color",
    "connected_components",
    "classify_motion",
    "detect",
    "detect_batch",
    "detected_attributes",
]

FG_DIST = 0.2  # RGB distance from the background that counts as foreground (palette colours are >= 0.45 apart)
MIN_AREA_FRAC = 0.01  # components smaller than this share of a frame are specks (a small triangle is ~0.03)
MIN_PRESENT = 1 / 3  # an object must be found in at least this share of frames
MOVE_FRAC = 0.1  # an excursion under this share of the frame side is "still" (world motion is >= 0.25)
BOUNCE_RATIO = 0.6  # |net displacement| / excursion below this is a bounce (world bounces <= 0.46, lines ~1)
_CORE = 0.7  # core pixels: at least this share of the component's largest distance from the background
# small / large boundary on the bounding-box side (fraction of the frame): midway between the two sizes
_SIZE_SPLIT = RADIUS_FRAC["small"] + RADIUS_FRAC["large"]


def palette(device: torch.device | str = "cpu") -> tuple[list[str], torch.Tensor]:
    """The named colours: (names, RGB [K, 3] float32)."""
    return list(COLORS), torch.tensor(list(COLORS.values()), dtype=torch.float32, device=device)


def nearest_color(rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest named colour of every RGB in ``rgb`` [..., 3]: (palette index [...] int64, distance [...])."""
    _, pal = palette(rgb.device)
    dist = (rgb.float()[..., None, :] - pal).norm(dim=-1)  # [..., K]
    d, i = dist.min(dim=-1)
    return i, d


def connected_components(mask: torch.Tensor) -> torch.Tensor:
    """8-connected components of each frame of ``mask`` [N, H, W] bool: labels [N, H, W] int64, 0 off the mask.

    Every pixel starts with its own index and takes the largest index of its 3x3 neighbours inside the mask until
    nothing changes, so a component ends labelled by its largest pixel index (iterations ~ its diameter).
    """
    n, h, w = mask.shape
    # float32 holds integers up to 2**24 exactly: frames up to 4096 x 4096
    idx = torch.arange(1, h * w + 1, dtype=torch.float32, device=mask.device).view(1, h, w)
    m = mask.to(torch.float32)  # [N, H, W]
    lab = idx * m
    while True:
        new = F.max_pool2d(lab[:, None], 3, stride=1, padding=1)[:, 0] * m  # [N, H, W]
        if torch.equal(new, lab):
            return lab.to(torch.int64)
        lab = new


def classify_motion(track: torch.Tensor, size: int) -> str:
    """Motion of a centroid track [F, 2] (x, y px, NaN where absent) in a frame of side ``size``:
    "left", "right", "up", "down", "bounces" or "still"."""
    p = track[~torch.isnan(track[:, 0])]  # [F', 2]
    if p.shape[0] < 2:
        return "still"
    net = p[-1] - p[0]  # [2]
    excursion = p.max(dim=0).values - p.min(dim=0).values  # [2]
    axis = int(excursion.argmax())
    if float(excursion[axis]) < MOVE_FRAC * size:
        return "still"
    if abs(float(net[axis])) < BOUNCE_RATIO * float(excursion[axis]):
        return "bounces"
    forward = float(net[axis]) > 0
    return ("right" if forward else "left") if axis == 0 else ("down" if forward else "up")


@dataclass(frozen=True)
class DetectedObject:
    """One object found in a clip (an object is tracked by its named colour)."""

    color: str  # nearest named colour of its core pixels
    rgb: tuple[float, float, float]  # measured core colour
    shape: str  # best template: circle, square or triangle
    shape_iou: float  # IoU of its mask with that template, median over frames (1 = a clean known shape)
    size: str  # small or large
    extent: float  # bounding-box side / frame side, median over frames
    area: torch.Tensor  # [F] share of the frame it covers (0 where absent)
    track: torch.Tensor  # [F, 2] centroid (x, y) in px, NaN where absent
    motion: str  # left, right, up, down, bounces or still
    present: float  # share of frames where it was found


@dataclass(frozen=True)
class Detection:
    """What the detectors read from one clip."""

    background: str  # nearest named colour of the background
    background_rgb: tuple[float, float, float]  # measured (median) background colour
    objects: tuple[DetectedObject, ...]  # largest (total area) first
    object_mask: torch.Tensor  # [F, H, W] bool, union of the objects' masks (coverage > 0.5)
    support: torch.Tensor  # [F, H, W] bool, pixels the objects tint at all (their components grown by a pixel)


def _check_clip(video: torch.Tensor) -> None:
    if video.ndim != 4 or video.shape[1] != 3 or not video.is_floating_point():
        raise ValueError(f"expected a float clip [F, 3, H, W] in [0, 1], got {tuple(video.shape)} {video.dtype}")


def fit_boxes(cover: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For each shape, the box (centres [N, 2], half sides [N, 2], px) that a shape of that kind with the soft masks'
    first and second moments would have. ``cover`` [N, H, W] in [0, 1], each with some mass.

    Moments use every pixel's coverage, so they are sub-pixel exact on anti-aliased renders, and a blur only adds
    its own small variance (0.5 px^2 for a [1, 2, 1] kernel) instead of flipping whole edge rows in or out of a mask.
    Per shape, a box of half sides (a, b): square var = a^2/3; ellipse var = a^2/4; an apex-up triangle of base 2a
    and height 2b has var_x = (2a)^2/24, var_y = (2b)^2/18 and its centroid 2/3 of the height below the apex.
    """
    n, h, w = cover.shape
    ys = torch.arange(h, dtype=torch.float64).view(1, h, 1) + 0.5  # pixel centres
    xs = torch.arange(w, dtype=torch.float64).view(1, 1, w) + 0.5
    c = cover.double()
    m0 = c.sum(dim=(1, 2)).clamp_min(1e-6)  # [N]
    cx = (c * xs).sum(dim=(1, 2)) / m0  # [N]
    cy = (c * ys).sum(dim=(1, 2)) / m0
    vx = (c * (xs - cx.view(n, 1, 1)).square()).sum(dim=(1, 2)) / m0  # [N]
    vy = (c * (ys - cy.view(n, 1, 1)).square()).sum(dim=(1, 2)) / m0
    centroid = torch.stack([cx, cy], dim=1)  # [N, 2]
    tri_h = (18 * vy).sqrt()  # [N] triangle height
    return {
        "circle": (centroid, torch.stack([(4 * vx).sqrt(), (4 * vy).sqrt()], dim=1)),
        "square": (centroid, torch.stack([(3 * vx).sqrt(), (3 * vy).sqrt()], dim=1)),
        "triangle": (
            torch.stack([cx, cy - tri_h / 6], dim=1),  # the box's middle is h/6 above the centroid
            torch.stack([(6 * vx).sqrt(), tri_h / 2], dim=1),
        ),
    }


def shape_scores(cover: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft IoU of each soft mask ``cover`` [N, H, W] with each shape fitted to its moments: ([N, S], half sides
    [N, S, 2] of the fitted boxes), S in the order of `SHAPES`. IoU = sum(min) / sum(max) of the coverages."""
    n, h, w = cover.shape
    boxes = fit_boxes(cover)
    ious, halves = [], []
    for shape in SHAPES:
        centres, radii = boxes[shape]
        tmpl = shape_coverage(shape, centres, radii.clamp_min(0.25), h, w)  # [N, H, W]
        inter = torch.minimum(tmpl, cover).sum(dim=(1, 2))
        union = torch.maximum(tmpl, cover).sum(dim=(1, 2)).clamp_min(1e-6)
        ious.append(inter / union)
        halves.append(radii.float())
    return torch.stack(ious, dim=1), torch.stack(halves, dim=1)


def detect(video: torch.Tensor, max_objects: int = 3) -> Detection:
    """Read the background and up to ``max_objects`` objects from a clip float [F, 3, H, W] in [0, 1]."""
    _check_clip(video)
    x = video.detach().float().cpu().clamp(0, 1)  # [F, 3, H, W]
    nf, _, h, w = x.shape
    names, pal = palette()
    bg = x.permute(1, 0, 2, 3).reshape(3, -1).median(dim=1).values  # [3]
    bg_name = names[int(nearest_color(bg)[0])]
    dist = (x - bg.view(1, 3, 1, 1)).norm(dim=1)  # [F, H, W]
    labels = connected_components(dist > FG_DIST)  # [F, H, W]
    min_area = MIN_AREA_FRAC * h * w

    # per frame, the largest component of each named colour: name -> {frame: (pixel mask [H, W], core rgb [3])}
    found: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for f in range(nf):
        ids, counts = labels[f].unique(return_counts=True)
        for lab, count in sorted(zip(ids.tolist(), counts.tolist()), key=lambda t: -t[1]):
            if lab == 0 or count < min_area:
                continue
            comp = labels[f] == lab  # [H, W]
            d = dist[f][comp]  # [P]
            core = x[f].permute(1, 2, 0)[comp][d >= _CORE * d.max()]  # [P', 3]
            rgb = core.median(dim=0).values  # [3]
            name = names[int(nearest_color(rgb)[0])]
            if name == bg_name:  # a patch of background colour drawn apart from the median: not an object
                continue
            found.setdefault(name, {}).setdefault(f, (comp, rgb))  # sorted by size: the first is the largest

    objects = []
    for name, frames in found.items():
        if len(frames) < MIN_PRESENT * nf:
            continue
        rgb = torch.stack([c for _, c in frames.values()]).median(dim=0).values  # [3]
        axis = rgb - bg  # [3] direction from background to object colour
        # coverage of each pixel along background -> object colour (1 = object colour, 0.5 = the shape's edge),
        # kept within the component grown by one pixel, so faint anti-aliased edges count and other blobs do not
        cover_all = ((x - bg.view(1, 3, 1, 1)) * axis.view(1, 3, 1, 1)).sum(1) / axis.square().sum().clamp_min(1e-6)
        region = torch.zeros(nf, h, w, dtype=torch.bool)  # [F, H, W]
        for f, (comp, _) in frames.items():
            region[f] = comp
        region = F.max_pool2d(region[:, None].float(), 3, stride=1, padding=1)[:, 0] > 0
        cover = torch.where(region, cover_all.clamp(0, 1), torch.zeros(()))  # [F, H, W]
        present = torch.tensor([f in frames for f in range(nf)])  # [F]
        mass = cover.flatten(1).sum(dim=1)  # [F] object area in px
        area = mass / (h * w)  # [F]
        ys = torch.arange(h, dtype=torch.float32).view(1, h, 1) + 0.5
        xs = torch.arange(w, dtype=torch.float32).view(1, 1, w) + 0.5
        cx = (cover * xs).flatten(1).sum(dim=1) / mass.clamp_min(1e-6)
        cy = (cover * ys).flatten(1).sum(dim=1) / mass.clamp_min(1e-6)
        track = torch.stack([cx, cy], dim=1)  # [F, 2]
        track[~present] = float("nan")
        ious, halves = shape_scores(cover[present])  # [F', S], [F', S, 2]
        med = ious.median(dim=0).values  # [S]
        k = int(med.argmax())
        extent = float((2 * halves[:, k].max(dim=1).values).median()) / max(h, w)
        objects.append((cover > 0.5, region, DetectedObject(
            color=name,
            rgb=tuple(float(v) for v in rgb),
            shape=SHAPES[k],
            shape_iou=float(med[k]),
            size="large" if extent > _SIZE_SPLIT else "small",
            extent=extent,
            area=area,
            track=track,
            motion=classify_motion(track, max(h, w)),
            present=float(present.float().mean()),
        )))
    objects.sort(key=lambda t: -float(t[2].area.sum()))
    objects = objects[:max_objects]
    union = torch.zeros(nf, h, w, dtype=torch.bool)
    support = torch.zeros(nf, h, w, dtype=torch.bool)
    for masks, region, _ in objects:
        union |= masks
        support |= region
    return Detection(bg_name, tuple(float(v) for v in bg), tuple(o for _, _, o in objects), union, support)


def detect_batch(videos: torch.Tensor, max_objects: int = 3) -> list[Detection]:
    """`detect` for each video of a batch float [B, F, 3, H, W]."""
    if videos.ndim != 5:
        raise ValueError(f"expected videos [B, F, 3, H, W], got {tuple(videos.shape)}")
    return [detect(v, max_objects) for v in videos]


def detected_attributes(det: Detection, num_objects: int = 1) -> Attributes | None:
    """The world attributes a detection reads as, taking its ``num_objects`` largest objects and the first's motion;
    None when it found fewer objects or they do not form a drawable clip (e.g. a colour repeated)."""
    if len(det.objects) < num_objects:
        return None
    objs = det.objects[:num_objects]
    motion = objs[0].motion
    if motion == "still":
        return None
    try:
        return Attributes(tuple(ObjectAttrs(o.size, o.color, o.shape) for o in objs), motion, det.background)
    except SageGRPOError:  # a detection need not be a drawable clip (two objects of one colour, ...)
        return None
