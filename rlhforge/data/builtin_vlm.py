"""Built-in image tasks with verifiable answers (for VLM RL and its quick start): ``builtin:shape_colour``.

Each record's image is drawn on the fly (PIL, deterministic): one filled shape (square, circle or
triangle) of a colour from a fixed palette, at a seeded size and place on a grey canvas, sometimes
with a small grey distractor dot. The question is "What colour is the shape?"; the answer is the
colour's name. Train and test problems are disjoint (a problem is the colour, shape, canvas size,
shape box; one in ten goes to the test split, as for the text tasks).

Record fields::

    {"prompt": "<image>What colour is the shape? Answer with one word.", "images": [PIL image],
     "answer": "red", "completion": "red", "datasource": "shape_colour",
     "messages": [{"role": "user", ...}, {"role": "assistant", "content": "red"}]}

Parameters (``builtin:shape_colour?n=2000&seed=3&colours=4@test``): ``n``, ``seed``, ``colours``
(how many of the palette's colours, 2..6; default 4), ``format_only`` (1: the same questions *without*
their images, each answered by a colour drawn uniformly: a warm start that teaches the answer format
and nothing about images; the VLM quick start's SFT stage). The reward ``builtin:shape_colour`` is 1.0
iff the first word of the response is the colour.
"""

from __future__ import annotations

import random
import re
import zlib

from rlhforge.data.builtin import TEST_SPLITS, register_builtin
from rlhforge.data.errors import DataError

__all__ = ["PALETTE", "shape_image", "generate_shape_colour", "check_shape_colour"]

NAME = "shape_colour"
PALETTE = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "purple": (150, 60, 190), "orange": (240, 140, 30)}
SIZES = (28, 42, 56)
PROMPT = "<image>What colour is the shape? Answer with one word."


def shape_image(colour: str, shape: str, width: int, height: int, box: tuple[int, int, int], dot: bool):
    """The RGB image of one problem: a ``colour`` ``shape`` in ``box`` = (x, y, side) on grey."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    x, y, side = box
    fill = PALETTE[colour]
    if shape == "square":
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=fill)
    elif shape == "circle":
        draw.ellipse((x, y, x + side - 1, y + side - 1), fill=fill)
    else:
        draw.polygon([(x, y + side - 1), (x + side - 1, y + side - 1), (x + side // 2, y)], fill=fill)
    if dot:
        draw.ellipse((width - 6, height - 6, width - 2, height - 2), fill=(90, 90, 90))
    return image


def _problems(colours: int, rng: random.Random, want_test: bool, n: int) -> list[tuple]:
    names = list(PALETTE)[:colours]
    out = []
    while len(out) < n:
        w, h = rng.choice(SIZES), rng.choice(SIZES)
        side = rng.randint(max(8, min(w, h) // 3), min(w, h) - 4)
        problem = (rng.choice(names), rng.choice(("square", "circle", "triangle")), w, h,
                   (rng.randint(0, w - side), rng.randint(0, h - side), side), rng.random() < 0.3)
        if (zlib.crc32(repr(problem).encode()) % 10 == 0) == want_test:
            out.append(problem)
    return out


def generate_shape_colour(split: str = "train", n: int = 1000, seed: int = 0, colours: int = 4,
                          format_only: int = 0) -> list[dict]:
    if not 2 <= colours <= len(PALETTE):
        raise DataError(f"builtin:{NAME}: colours must be 2..{len(PALETTE)} (got {colours})")
    if n < 1:
        raise DataError(f"builtin:{NAME}: n must be >= 1 (got {n})")
    want_test = split in TEST_SPLITS
    rng = random.Random(seed + (1_000_003 if want_test else 0))
    records = []
    for problem in _problems(colours, rng, want_test, n):
        if format_only:  # no image, a colour at random: the format without the task
            prompt, colour, images = PROMPT.replace("<image>", ""), rng.choice(list(PALETTE)[:colours]), []
        else:
            prompt, colour, images = PROMPT, problem[0], [shape_image(*problem)]
        records.append({"prompt": prompt, "images": images, "answer": colour, "completion": colour, "datasource": NAME,
                        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": colour}]})
    return records


def check_shape_colour(completion: str, answer: str) -> float:
    """1.0 iff the first word (letters) of ``completion`` is ``answer`` (case-insensitive)."""
    word = re.search(r"[A-Za-z]+", completion)
    return float(word is not None and word.group(0).lower() == answer.lower())


register_builtin(NAME, generate_shape_colour, {"colours": 4, "format_only": 0}, check=check_shape_colour)
