"""Write a small image SFT / DPO data set of coloured shapes (for examples/sft_vlm.yaml, dpo_vlm.yaml).

    python examples/make_shapes_data.py runs/shapes [N]

writes ``runs/shapes/img/*.png`` and two JSON Lines files whose image paths are relative to them:
``sft.jsonl`` (``{"messages", "images"}``: "What colour is the shape?" -> the colour) and
``dpo.jsonl`` (``{"prompt", "chosen", "rejected", "images"}``: the colour over a wrong colour).
"""

import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220)}


def main(out: str, n: int = 300, seed: int = 0) -> None:
    rng = random.Random(seed)
    root = Path(out)
    (root / "img").mkdir(parents=True, exist_ok=True)
    sft, dpo = [], []
    for i in range(n):
        colour = rng.choice(list(COLOURS))
        w, h = rng.choice([28, 42, 56]), rng.choice([28, 42, 56])
        image = Image.new("RGB", (w, h), (128, 128, 128))
        side = min(w, h) // 2
        x, y = rng.randint(0, w - side), rng.randint(0, h - side)
        draw = ImageDraw.Draw(image)
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)((x, y, x + side - 1, y + side - 1), fill=COLOURS[colour])
        image.save(root / "img" / f"{i}.png")
        question, images = "<image>What colour is the shape?", [f"img/{i}.png"]
        sft.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": colour}],
                    "images": images})
        wrong = rng.choice([c for c in COLOURS if c != colour])
        dpo.append({"prompt": question, "chosen": colour, "rejected": wrong, "images": images})
    for name, rows in (("sft.jsonl", sft), ("dpo.jsonl", dpo)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {n} records to {root}/sft.jsonl and {root}/dpo.jsonl")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
