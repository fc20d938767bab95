"""Environments whose observations carry pictures, for tests/test_vision_turns.py: one that behaves and one per way a
picture can be wrong. Imported by the environment workers (spec "modules"), so nothing here imports torch."""
import io

from PIL import Image

from registry import register


def png(size=(32, 32), color="red", fmt="PNG", mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


MODES = {   # what step returns as its observation in each mode
    "fine": lambda: {"text": "<image>red circles?", "image": png()},
    "jpeg": lambda: {"text": "look <image>", "image": png(fmt="JPEG")},
    "huge_bytes": lambda: {"text": "<image>", "image": png() + b"\0" * 20000},     # past a 16 KB cap, still a PNG
    "bomb": lambda: {"text": "<image>", "image": png(size=(3000, 3000), color=0, mode="1")},   # 1 KB, 9 M pixels
    "gif": lambda: {"text": "<image>", "image": png(fmt="GIF")},
    "thin": lambda: {"text": "<image>", "image": png(size=(1, 600))},   # a PNG the model's processor refuses
    "garbage": lambda: {"text": "<image>", "image": b"\x89PNG\r\n\x1a\n" + b"\xff" * 64},
    "truncated": lambda: {"text": "<image>", "image": png()[:60]},
    "path": lambda: {"text": "<image>", "image": "/etc/hostname"},
    "no_slot": lambda: {"text": "no slot", "image": png()},
    "two_slots": lambda: {"text": "<image><image>", "image": png()},
    "extra_key": lambda: {"text": "<image>", "image": png(), "more": 1},
    "subclass": lambda: type("Sneaky", (dict,), {})(text="<image>", image=png()),
}


@register("env", "picture")
class Picture:
    """reset shows a picture; step answers in its mode (fields["mode"]) and ends after the second turn."""

    def __init__(self):
        self.mode, self.turns = "fine", 0

    def reset(self, fields: dict):
        self.mode, self.turns = fields.get("mode", "fine"), 0
        return {"text": "<image>red circles?", "image": png(color="blue")}

    def step(self, action: str):
        self.turns += 1
        if self.turns >= 2:
            return None, 1.0, True, {"success": True}
        return MODES[self.mode](), 0.5, False, {}
