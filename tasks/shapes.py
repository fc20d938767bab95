"""The embedded vision task, `shapes`: small pictures the project draws with PIL, a question, a verifiable answer.

    python train.py --config configs/vision.yaml               # the tiny VLM of tools/make_tiny_vlm.py learns it
    get("task", "shapes")(None)[0][0]
    # {"prompt": "<image>red circles?", "image": b"\\x89PNG...", "answer": "2", "kind": "count"}

Two kinds of question, drawn half and half:
    count   "<image>red circles?"   how many red circles (1-4); blue circles and red squares are distractors.
                                    Answer: the digit.
    larger  "<image>larger? a circle b square"   one circle and one square of different sizes: which is larger
                                    (by area)? Answer: the letter (multiple choice, reward `vision`).
Shapes sit in the cells of a 4 x 4 grid, one per cell: a cell is one image token of the tiny VLM (16 x 16 pixels,
its patch 8 and 2 x 2 merge), which it learns to see far sooner than shapes that straddle tokens.
`<image>` marks where the picture sits in the prompt; vision.py replaces it with the model family's image tokens
(Qwen2-VL: <|vision_start|>, one <|image_pad|> per merged patch, <|vision_end|>). A row carries its picture as PNG
bytes in `image`: what a jsonl / parquet row would hold (a path to a file works too: vision.load_image).

Held-out split: a stable hash (blake2b) of the scene's description, so no held-out scene is ever trained on
(tools/make_tiny_vlm.py draws its supervised data from the train side too). The task takes no settings (like the
ladder's rungs): every run sees the same scenes.
"""
import io
import random

from PIL import Image, ImageDraw

from registry import register
from tasks.arithmetic import in_heldout

SIZE = 64                      # pixels per side (a multiple of the tiny VLM's patch x merge size)
IMAGE = "<image>"              # where the picture goes in the prompt (vision.py expands it)
N_TRAIN, N_EVAL, HELDOUT_PERCENT = 2000, 200, 10
MAX_COUNT = 4


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


GRID = 4                       # cells per side; a cell is CELL x CELL pixels
CELL = SIZE // GRID            # 16: one merged patch of the tiny VLM (patch 8, 2 x 2 merge), so one image token


def _cells(rng: random.Random, k: int) -> list[tuple[int, int]]:
    """k distinct cells of the GRID x GRID grid, as top-left pixel corners (shapes never overlap). A cell is one
    image token of the tiny VLM: each token shows at most one whole shape, which a tiny tower learns to see fast."""
    return [(c % GRID * CELL, c // GRID * CELL) for c in rng.sample(range(GRID * GRID), k)]


def draw_count(rng: random.Random) -> tuple[dict, str]:
    """Red circles to count among blue circles and red squares. -> (scene, answer)."""
    red = rng.randint(1, MAX_COUNT)
    blue, squares = rng.randint(0, 2), rng.randint(0, 2)
    kinds = ["red circle"] * red + ["blue circle"] * blue + ["red square"] * squares
    return {"kind": "count", "items": list(zip(kinds, _cells(rng, len(kinds))))}, str(red)


def draw_larger(rng: random.Random) -> tuple[dict, str]:
    """A circle and a square of different sizes. -> (scene, "a" if the circle's area is larger else "b")."""
    small, big = rng.choice([(4, 10), (4, 12), (6, 12), (6, 14), (4, 14), (8, 14)])
    circle_big = rng.random() < 0.5
    r, side = (big, small) if circle_big else (small, big)
    # the sizes are the circle's diameter and the square's side: with the pairs above the larger size always has
    # the larger area, by a clear margin (pi/4 d^2 against s^2)
    return {"kind": "larger", "items": [("circle", r), ("square", side)],
            "at": _cells(rng, 2)}, "a" if circle_big else "b"


def render(scene: dict) -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE), "white")
    d = ImageDraw.Draw(img)
    if scene["kind"] == "count":
        for kind, (x, y) in scene["items"]:
            box = (x + 2, y + 2, x + CELL - 3, y + CELL - 3)
            color = "red" if kind.startswith("red") else "blue"
            (d.ellipse if kind.endswith("circle") else d.rectangle)(box, fill=color)
    else:
        for (shape, half), (x, y) in zip(scene["items"], scene["at"]):
            cx, cy = x + CELL // 2, y + CELL // 2
            box = (cx - half // 2, cy - half // 2, cx + half // 2, cy + half // 2)
            (d.ellipse if shape == "circle" else d.rectangle)(box, fill="green")
    return img


PROMPTS = {"count": f"{IMAGE}red circles?", "larger": f"{IMAGE}larger? a circle b square"}


def is_heldout(scene: dict) -> bool:
    return in_heldout(repr(scene), HELDOUT_PERCENT)


def shapes_samples(n: int, heldout: bool, seed: int = 0) -> list[dict]:
    """n rows from one side of the split (each side its own seeded stream), deterministic."""
    rng = random.Random(f"shapes-{'eval' if heldout else 'train'}-{seed}")
    out = []
    while len(out) < n:
        scene, answer = (draw_count if rng.random() < 0.5 else draw_larger)(rng)
        if is_heldout(scene) == heldout:
            row = {"prompt": PROMPTS[scene["kind"]], "image": png(render(scene)), "answer": answer,
                   "kind": scene["kind"], "scene": repr(scene)}
            out.append({**row, "choices": "ab"} if scene["kind"] == "larger" else row)
    return out


@register("task", "shapes")
def shapes_task(_section=None) -> tuple[list[dict], list[dict]]:
    """(train, held_out); the task takes no settings (config.py has no section for it)."""
    return shapes_samples(N_TRAIN, False), shapes_samples(N_EVAL, True)
