"""Write a tiny image-editing dataset and a tiny random CLIP model for the CPU Kontext demo.

    python tools/make_edit_demo.py runs/edit_demo

``OUT/data`` is an edit dataset in FlowGRPO's layout: ``train_metadata.jsonl`` and ``test_metadata.jsonl``, one
``{"prompt": instruction, "image": "images/<name>"}`` per line, and the source pictures (drawn shapes on plain or
striped backgrounds, JPEG and PNG, of several sizes and aspect ratios, so that the reader's resize and crop have
work to do). ``OUT/clip`` is a tiny random ``CLIPModel`` with its processor and tokenizer: NOT a trained model, it
only lets the demo run the real consistency and text rewards (``yaml_configs/flux_kontext/tiny_edit.yaml``).
The output is the same on every run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from PIL import Image, ImageDraw

from leangrpo_mcore.cli.common import run_main
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.rl.rewards.tiny_clip import write_tiny_clip_dir

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40),
           "white": (245, 245, 245), "black": (20, 20, 20)}
SHAPES = ("square", "circle", "triangle")
SIZES = ((48, 64), (64, 48), (80, 80), (40, 72))
TRAIN, TEST = 8, 4


def _picture(index: int) -> tuple[Image.Image, str, str, str]:
    """Source picture ``index``: (image, its shape, its colour, the background colour)."""
    names = list(COLOURS)
    shape, colour = SHAPES[index % len(SHAPES)], names[index % len(names)]
    background = names[(index * 2 + 3) % len(names)]
    if background == colour:
        background = names[(names.index(colour) + 1) % len(names)]
    height, width = SIZES[index % len(SIZES)]
    image = Image.new("RGB", (width, height), COLOURS[background])
    draw = ImageDraw.Draw(image)
    if index % 2:  # stripes: texture for the resampler
        for x in range(0, width, 6):
            draw.line([(x, 0), (x, height)], fill=tuple(c // 2 for c in COLOURS[background]), width=2)
    box = (width // 4, height // 4, 3 * width // 4, 3 * height // 4)
    if shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    else:
        draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=COLOURS[colour])
    return image, shape, colour, background


def _instruction(index: int, shape: str, colour: str, background: str) -> str:
    names = [n for n in COLOURS if n not in (colour, background)]
    new = names[index % len(names)]
    kinds = (f"make the {shape} {new}", f"turn the background {new}", f"make the {colour} {shape} larger",
             f"remove the {shape}")
    return kinds[index % len(kinds)]


def write_demo(out: Path) -> None:
    """The dataset under ``out/data`` and the tiny CLIP model under ``out/clip`` (module doc)."""
    data, images = out / "data", out / "data" / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(TRAIN + TEST):
        image, shape, colour, background = _picture(index)
        name = f"{index:02d}_{shape}.{'jpg' if index % 3 == 0 else 'png'}"
        image.save(images / name, **({"quality": 92} if name.endswith(".jpg") else {}))
        rows.append({"prompt": _instruction(index, shape, colour, background), "image": f"images/{name}"})
    for split, part in (("train", rows[:TRAIN]), ("test", rows[TRAIN:])):
        (data / f"{split}_metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part),
                                                      encoding="utf-8")
    clip = out / "clip"
    clip.mkdir(parents=True, exist_ok=True)
    write_tiny_clip_dir(clip)


def _main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="output directory (data/ and clip/ are written into it)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    write_demo(out)
    print(f"wrote {out / 'data'} ({TRAIN} train, {TEST} test edits) and a tiny random CLIP model in {out / 'clip'}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: one-line errors and exit code 2 for bad input."""
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
