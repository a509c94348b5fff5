"""Generated shape images: a seeded image task with as many i.i.d. images per class as a claim needs.

The digits demo can certify only what 44-46 held-out images per digit allow (about 10-15 points lost per digit):
a claim of "at most 3 points lost per class" at delta 0.05 needs at least 102 certification images per class
with nothing forgotten and thousands at a realistic 1-2% forgotten. This generator draws small grey-scale
images of simple shapes (:data:`SHAPES`: circle, ring, square, frame, triangle, cross, diamond, bar) with a
random size, position, rotation (where it shows), foreground and background intensity and pixel noise, so
that every split of the example can be as large as its purpose requires.

**Independence by construction.** :func:`draw_shapes` draws every image of one (seed, stream, class) from its
own :class:`numpy.random.SeedSequence` ``[seed, stream, class]``; the example gives each split (stage 1, the
constraint data, the selection split, the held-out / certification images) a different ``stream``, so the
splits are independent samples from the same distribution and no image is drawn twice (continuous parameters
and pixel noise: two draws coincide with probability zero; the tests check it on the bytes).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

SHAPES: tuple[str, ...] = ("circle", "ring", "square", "frame", "triangle", "cross", "diamond", "bar")
"""The shape classes, in label order; each is captioned ``"a photo of a {name}"`` by the example."""

Renderer = Callable[[int, int, np.random.Generator, int, float, Sequence[str]], np.ndarray]
"""``render(label, n, rng, image_size, noise, classes)``: ``n`` images of class ``label`` drawn from ``rng``."""

_SUPERSAMPLE = 2  # shapes are drawn at twice the resolution and averaged down: soft, anti-aliased edges


def _masks(name: str, x: np.ndarray, y: np.ndarray, r: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """The boolean mask of shape ``name`` at offsets ``(x, y)`` from the centre (pixels, broadcast as
    (N, H, W)) for radius ``r`` and rotation ``angle`` (N, 1, 1)."""
    c, s = np.cos(angle), np.sin(angle)
    u, v = c * x + s * y, -s * x + c * y  # rotated coordinates (square, frame, triangle, cross, bar)
    d = np.hypot(x, y)
    box = np.maximum(np.abs(u), np.abs(v))
    if name == "circle":
        return d <= r
    if name == "ring":
        return (d <= r) & (d >= 0.55 * r)
    if name == "square":
        return box <= 0.8 * r
    if name == "frame":
        return (box <= 0.85 * r) & (box >= 0.5 * r)
    if name == "triangle":  # apex up (before rotation), base at v = 0.6 r
        top, bottom = -r, 0.6 * r
        return (v >= top) & (v <= bottom) & (np.abs(u) <= (v - top) / (bottom - top) * r)
    if name == "cross":
        arm = 0.3 * r
        return ((np.abs(u) <= arm) & (np.abs(v) <= r)) | ((np.abs(v) <= arm) & (np.abs(u) <= r))
    if name == "diamond":
        return np.abs(u) + np.abs(v) <= r
    if name == "bar":
        return (np.abs(v) <= 0.28 * r) & (np.abs(u) <= 1.1 * r)
    raise ValueError(f"unknown shape {name!r}: one of {list(SHAPES)}")


def render_shapes(label: int, n: int, rng: np.random.Generator, image_size: int = 16, noise: float = 0.1,
                  classes: Sequence[str] = SHAPES) -> np.ndarray:
    """``n`` images (n, 1, image_size, image_size) of shape ``classes[label]`` in [-1, 1], drawn from ``rng``.

    Per image: radius 30-45% of the side, centre within 15% of the side of the middle, a rotation (any angle
    for the triangle, cross and bar; within 15 degrees of upright for the square, frame and diamond, so that no
    square looks like a diamond; none shows on the circle and ring), a dark background in [-1, -0.5], a
    foreground brighter by 0.8-1.8 (clipped at 1), and Gaussian pixel noise of std ``noise``.
    """
    if not 0 <= label < len(classes):
        raise ValueError(f"label {label} out of range for {len(classes)} shape classes")
    return render_shape(classes[label], n, rng, image_size, noise)


def render_shape(name: str, n: int, rng: np.random.Generator, image_size: int = 16, noise: float = 0.1,
                 radius: tuple[float, float] = (0.30, 0.45), sign: float = 1.0) -> np.ndarray:
    """``n`` images of the shape ``name`` (:func:`render_shapes`' draws, in its order), the radius uniform in
    ``radius`` (shares of the side); ``sign`` -1: the image negated before the pixel noise (a dark shape on a
    bright background)."""
    side = image_size * _SUPERSAMPLE
    r = rng.uniform(*radius, size=(n, 1, 1)) * side
    cx = side / 2 + rng.uniform(-0.15, 0.15, size=(n, 1, 1)) * side
    cy = side / 2 + rng.uniform(-0.15, 0.15, size=(n, 1, 1)) * side
    # square and frame within 15 degrees of upright, the diamond within 15 degrees of 45 (a square turned by 45
    # degrees IS a diamond: the classes must not overlap); the triangle, cross and bar at any angle
    if name in ("square", "frame", "diamond"):
        angle = rng.uniform(-np.pi / 12, np.pi / 12, size=(n, 1, 1))
    else:
        angle = rng.uniform(0.0, np.pi, size=(n, 1, 1))
    background = rng.uniform(-1.0, -0.5, size=(n, 1, 1))
    foreground = np.minimum(background + rng.uniform(0.8, 1.8, size=(n, 1, 1)), 1.0)
    grid = np.arange(side) + 0.5
    x, y = grid[None, None, :] - cx, grid[None, :, None] - cy
    mask = _masks(name, x, y, r, angle).astype(np.float32)
    # anti-aliasing: the share of each pixel's sub-pixels inside the shape
    mask = mask.reshape(n, image_size, _SUPERSAMPLE, image_size, _SUPERSAMPLE).mean(axis=(2, 4))
    clean = background + (foreground - background) * mask
    img = (clean if sign == 1.0 else sign * clean) + rng.normal(0.0, noise, size=mask.shape)
    return np.clip(img, -1.0, 1.0).astype(np.float32)[:, None]


def draw_shapes(seed: int, stream: int, counts: Sequence[int], image_size: int = 16, noise: float = 0.1,
                classes: Sequence[str] = SHAPES, render: Optional[Renderer] = None) -> tuple[np.ndarray, np.ndarray]:
    """``counts[c]`` images of each class ``c`` and their labels, deterministic in ``(seed, stream)``.

    Class ``c`` is drawn from ``SeedSequence([seed, stream, c])``: the images of one class do not depend on the
    counts of the others, and different streams (the example's splits) are independent draws. ``render``: how
    ``n`` images of a class are drawn, ``render(label, n, rng, image_size, noise, classes)`` (default
    :func:`render_shapes`; :mod:`hf_constrained.clip.many_shapes` draws its 32 classes with its own).
    """
    if len(counts) != len(classes):
        raise ValueError(f"counts: one per class ({len(classes)}), got {len(counts)}")
    if seed < 0 or stream < 0:
        raise ValueError(f"seed and stream must be >= 0, got {seed} and {stream}")
    images, labels = [], []
    for c, n in enumerate(counts):
        rng = np.random.default_rng(np.random.SeedSequence([seed, stream, c]))
        images.append((render or render_shapes)(c, int(n), rng, image_size, noise, classes))
        labels.append(np.full(int(n), c, dtype=int))
    return np.concatenate(images), np.concatenate(labels)


__all__ = ["SHAPES", "Renderer", "draw_shapes", "render_shape", "render_shapes"]
