"""Synthetic images (coloured shapes, made with PIL) and image SFT data for the VLM tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220)}


def shape_image(colour: str, shape: str = "square", size: tuple[int, int] = (56, 56), seed: int = 0):
    """A ``colour`` square or circle at a seeded place on a grey background."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    w, h = size
    image = Image.new("RGB", size, (128, 128, 128))
    side = max(8, min(w, h) // 2)
    x, y = rng.randint(0, w - side), rng.randint(0, h - side)
    draw = ImageDraw.Draw(image)
    box = (x, y, x + side - 1, y + side - 1)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return image


def write_colour_data(folder: Path, n: int = 12, seed: int = 0, placeholder: bool = True) -> Path:
    """``folder/train.jsonl`` of ``{"messages", "images"}`` records (image paths relative to the file,
    under ``img/``): "What colour is the shape?" -> the colour name."""
    rng = random.Random(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour = list(COLOURS)[i % len(COLOURS)]
        size = (rng.choice([28, 42, 56]), rng.choice([28, 42, 56]))
        shape_image(colour, rng.choice(["square", "circle"]), size, seed=seed * 1000 + i).save(folder / f"img/{i}.png")
        question = "<image>What colour is the shape?" if placeholder else "What colour is the shape?"
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": colour}], "images": [f"img/{i}.png"]})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
