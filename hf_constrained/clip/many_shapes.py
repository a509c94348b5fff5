"""Generated images of 32 classes: each shape of :mod:`hf_constrained.clip.shapes` in two sizes and two tones.

The many-class example (``recipes/shapes_many_classes_example.py``) protects 31 old classes while it learns a
new one, so that the question is the *worst* class, not the average. Its classes combine the eight shapes
(circle, ring, square, frame, triangle, cross, diamond, bar) with a size band (``small``: radius 20-28% of the
side; ``large``: 36-46%) and a tone (``bright``: a bright shape on a dark background, as the eight-shape
example draws; ``dark``: the same picture negated, a dark shape on a bright background), named
``"{size} {tone} {shape}"`` (:data:`MANY_SHAPES`, in label order) and captioned ``"a photo of a {name}"``.

The classes differ in difficulty: the tone is seen at a glance, the size band needs the shape's extent, and a
small triangle, diamond or cross spans 6-9 pixels of a 16x16 image. Some are close to each other by
construction: the classes that share a shape and a tone differ only in size, those that share a shape and a size
only in tone (a new class ``large bright ring`` has ``small bright ring``, ``large dark ring`` and ``large bright
circle`` beside it).

**Independence by construction**, as :mod:`hf_constrained.clip.shapes`: class ``c`` of split ``stream`` is drawn
from ``SeedSequence([seed, stream, c])`` (:func:`draw_many_shapes` is :func:`~hf_constrained.clip.shapes.
draw_shapes` with this module's renderer), so the splits are independent samples and a class's images do not
depend on how many images the other classes get. Every draw is :func:`~hf_constrained.clip.shapes.render_shape`'s
(size, position, rotation, intensities, pixel noise), with this module's radius band and tone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .shapes import SHAPES, draw_shapes, render_shape

SIZES: dict[str, tuple[float, float]] = {"small": (0.25, 0.31), "large": (0.37, 0.46)}
"""The size bands: the radius as a share of the image side (the eight-shape example draws 0.30-0.45)."""
TONES: dict[str, float] = {"bright": 1.0, "dark": -1.0}
"""The tones: the eight-shape example's picture (bright on dark), or that picture negated (dark on bright)."""

MANY_SHAPES: tuple[str, ...] = tuple(f"{size} {tone} {shape}" for shape in SHAPES for size in SIZES for tone in TONES)
"""The 32 classes in label order: per shape (in :data:`~hf_constrained.clip.shapes.SHAPES`' order) small bright,
small dark, large bright, large dark; e.g. 6 is ``large bright ring``, 2 ``large bright circle``."""


def parts(name: str) -> tuple[str, str, str]:
    """A class name's (size, tone, shape), e.g. ``("large", "bright", "ring")``; an unknown name is an error."""
    words = name.split()
    if len(words) != 3 or words[0] not in SIZES or words[1] not in TONES or words[2] not in SHAPES:
        raise ValueError(f"unknown class {name!r}: '<size> <tone> <shape>' with size in {list(SIZES)}, tone in "
                         f"{list(TONES)} and shape in {list(SHAPES)}")
    return words[0], words[1], words[2]


def render_many_shapes(label: int, n: int, rng: np.random.Generator, image_size: int = 16, noise: float = 0.1,
                       classes: Sequence[str] = MANY_SHAPES) -> np.ndarray:
    """``n`` images (n, 1, image_size, image_size) in [-1, 1] of class ``classes[label]`` drawn from ``rng``:
    its shape at a radius in its size band, in its tone, with the eight-shape example's position, rotation,
    intensities and pixel noise (std ``noise``)."""
    if not 0 <= label < len(classes):
        raise ValueError(f"label {label} out of range for {len(classes)} classes")
    size, tone, shape = parts(classes[label])
    return render_shape(shape, n, rng, image_size, noise, radius=SIZES[size], sign=TONES[tone])


def draw_many_shapes(seed: int, stream: int, counts: Sequence[int], image_size: int = 16, noise: float = 0.1,
                     classes: Sequence[str] = MANY_SHAPES) -> tuple[np.ndarray, np.ndarray]:
    """``counts[c]`` images of each class ``c`` and their labels, deterministic in ``(seed, stream)``, class ``c``
    from ``SeedSequence([seed, stream, c])`` (:func:`~hf_constrained.clip.shapes.draw_shapes`)."""
    return draw_shapes(seed, stream, counts, image_size, noise, classes, render=render_many_shapes)


__all__ = ["MANY_SHAPES", "SIZES", "TONES", "draw_many_shapes", "parts", "render_many_shapes"]
