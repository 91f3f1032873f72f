"""Labels beside plotted points that overlap no other text: each label tries spots around its point,
nearest first, and takes the first one that lies inside the axes and clear of the labels already
placed (and, where there is room, of every marker). Where no spot is free the caller hears so and
numbers the points instead (`numbered`: a number with no room joins its neighbour's, "3, 9").
Boxes are in display pixels of the figure's canvas; offsets and marker sizes in points (1/72 inch).
The figure's layout must be final (`fig.draw_without_rendering()`) before anything is placed: a
label is placed where its point is drawn.
"""
from __future__ import annotations

import numpy as np
from matplotlib.text import Annotation, Text
from matplotlib.transforms import Bbox

# (x, y) direction from the point, and the label's alignment there, in order of preference: right of
# the point first (a label reads on from its marker), then left, then above and below.
DIRECTIONS = ((0.71, 0.71, "left", "bottom"), (1, 0, "left", "center"), (0.71, -0.71, "left", "top"),
              (-0.71, 0.71, "right", "bottom"), (-1, 0, "right", "center"), (-0.71, -0.71, "right", "top"),
              (0, 1, "center", "bottom"), (0, -1, "center", "top"))
GAPS = (2, 8, 16, 28, 44)  # points between a marker's edge and its label; past the first a thin line joins them
PAD = 1.5  # pixels kept clear around each label
CROWD = 40  # points: a label is placed earlier the more points lie this close (fewer spots left for it)


def box(text: Text, renderer) -> Bbox:
    """The text's own box (an annotation's arrow left out), padded by PAD pixels."""
    if isinstance(text, Annotation):
        text.update_positions(renderer)  # where its offset puts it (the arrow's box would be joined in)
    return Text.get_window_extent(text, renderer).padded(PAD)


def _inside(b: Bbox, frame: Bbox) -> bool:
    return frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1


def _extents(boxes) -> np.ndarray:
    """Boxes as an (n, 4) array of x0, y0, x1, y1, each interval in order (as Bbox.overlaps takes it)."""
    e = np.array([b.extents for b in boxes], dtype=float).reshape(-1, 4)
    return np.hstack([np.minimum(e[:, :2], e[:, 2:]), np.maximum(e[:, :2], e[:, 2:])])


def _clear(b: Bbox, boxes: np.ndarray) -> bool:
    """Whether `b` overlaps none of `boxes` (_extents), edges touching counted as overlap: Bbox.overlaps
    against every box at once (one by one in Python was seconds for a plot of hundreds of points)."""
    x0, y0, x1, y1 = _extents([b])[0]
    return not np.any((x0 <= boxes[:, 2]) & (boxes[:, 0] <= x1) & (y0 <= boxes[:, 3]) & (boxes[:, 1] <= y1))


def _markers(ax, points, radii) -> np.ndarray:
    """Each marker's box (_extents, pixels): its point, its radius (points) to each side."""
    px = ax.transData.transform(np.asarray(points, dtype=float).reshape(-1, 2))
    r = np.asarray(radii, dtype=float).reshape(-1, 1) * (ax.figure.dpi / 72)
    return np.hstack([px - r, px - r + 2 * r])


def _spot(ax, renderer, xy, text: str, radius: float, frame: Bbox, avoid: np.ndarray, style: dict):
    """The annotation at the first free spot around `xy` clear of `avoid` (_extents), or None
    (nothing left drawn)."""
    ann = ax.annotate(text, xy, xytext=(0, 0), textcoords="offset points", annotation_clip=False, **style)
    for gap in GAPS:
        r = radius + gap
        for dx, dy, ha, va in DIRECTIONS:
            ann.xyann = (dx * r, dy * r)
            ann.set(horizontalalignment=ha, verticalalignment=va)
            b = box(ann, renderer)
            if _inside(b, frame) and _clear(b, avoid):
                if gap != GAPS[0]:  # far from its point: a leader line says whose label it is
                    ann.remove()
                    ann = ax.annotate(text, xy, xytext=(dx * r, dy * r), textcoords="offset points",
                                      ha=ha, va=va, annotation_clip=False, **style,
                                      arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5", shrinkA=1,
                                                      shrinkB=radius * 0.8))
                ann.set_in_layout(False)  # inside the axes: it must not move the layout it was placed in
                return ann
    ann.remove()
    return None


def place(ax, points, texts, radii, avoid=(), over_markers: bool = True, others=((), ()),
          **style) -> tuple[list, int | None]:
    """Annotate each of `points` (data coordinates) with its text, `radii`: each marker's radius
    (points). A label keeps clear of every label placed and of `avoid` (boxes), and of every marker
    where it can (`over_markers`: else where none is free), the markers of `others` (points, radii:
    drawn but not labelled) included. Returns (the annotations, None), or ([], i) with nothing
    drawn when no spot is free for points[i]."""
    if not len(points):
        return [], None
    renderer = ax.figure.canvas.get_renderer()
    px = ax.transData.transform(np.asarray(points, dtype=float))
    scale = ax.figure.dpi / 72  # pixels per point
    frame = ax.get_window_extent(renderer)
    markers = np.vstack([_markers(ax, points, radii), _markers(ax, *others)])
    taken, done = _extents(avoid), []
    near = ((px[:, None] - px[None]) ** 2).sum(-1) < (CROWD * scale) ** 2
    for i in sorted(range(len(px)), key=lambda i: -near[i].sum()):  # the crowded first: stable for ties
        ann = _spot(ax, renderer, points[i], texts[i], radii[i], frame, np.vstack([taken, markers]), style)
        if ann is None and over_markers:  # crowded: over another marker rather than no label
            ann = _spot(ax, renderer, points[i], texts[i], radii[i], frame, taken, style)
        if ann is None:
            for a in done:
                a.remove()
            return [], i
        done.append(ann)
        taken = np.vstack([taken, _extents([box(ann, renderer)])])
    return done, None


def numbered(ax, points, radii, avoid=(), first: int = 1, others=((), ()), **style) -> list:
    """Number the points first, first + 1, ... beside them, no two numbers overlapping: points whose
    markers coincide share one label ("3, 9"), and a point left with no free spot joins the label of
    its nearest neighbour (so a single label remains at worst). `others`: as in place. Returns the
    annotations."""
    px = ax.transData.transform(np.asarray(points, dtype=float))
    scale = ax.figure.dpi / 72
    groups: list[list[int]] = []
    for i, p in enumerate(px):  # coincident: closer than the smaller marker's radius
        home = next((g for g in groups if np.hypot(*(px[g[0]] - p)) < min(radii[g[0]], radii[i]) * scale), None)
        home.append(i) if home is not None else groups.append([i])
    while True:
        texts = [", ".join(str(first + i) for i in g) for g in groups]
        anns, failed = place(ax, [points[g[0]] for g in groups], texts, [max(radii[i] for i in g) for g in groups],
                             avoid, others=others, **style)
        if failed is None:
            return anns
        if len(groups) == 1:  # one label left: anywhere inside the axes clear of `avoid`
            return place(ax, [points[groups[0][0]]], texts, [0.0], avoid, others=others, **style)[0]
        lost = groups.pop(failed)
        nearest = min(groups, key=lambda g: np.hypot(*(px[g[0]] - px[lost[0]])))
        nearest[:] = sorted(nearest + lost)


def uncrowded(texts, renderer) -> list:
    """The texts, in order, that overlap none kept before them (empty texts are never kept)."""
    kept: list = []
    for t in texts:
        if t.get_text() and not any(box(t, renderer).overlaps(box(k, renderer)) for k in kept):
            kept.append(t)
    return kept


def drop_crowded(texts, renderer) -> None:
    """Remove each text that overlaps one kept before it (uncrowded)."""
    kept = {id(t) for t in uncrowded(texts, renderer)}
    for t in texts:
        if id(t) not in kept:
            t.remove()


def thin_ticks(axis, renderer) -> None:
    """Blank each tick label of a fixed-tick axis (set_ticks with labels) that would overlap the one
    kept before it: batch sizes 8, 9, 10, 12 side by side on a log axis."""
    labels = [t.label1 for t in axis.get_major_ticks()]
    kept = {id(t) for t in uncrowded(labels, renderer)}
    axis.set_ticks(axis.get_ticklocs(), [t.get_text() if id(t) in kept else "" for t in labels])
