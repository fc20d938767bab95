"""The embedded multi-turn vision example, `shapes_pair`: two pictures in a row, one question each, the second picture
coming as the observation of the first turn (docs/vision.md: pictures as observations).

    python train.py --config configs/vision.yaml env.name=shapes_pair     # task=shapes rows, the tiny VLM, CPU

reset shows the row's picture and question; the model answers; step judges the answer (rewards/vision.py: reward 1
when right) and shows a second scene of the same side of the split with its question, as an observation with a
picture ({"text": "<image>question", "image": png bytes}); the second answer ends the episode (success: both right).
With the tiny VLM's character tokenizer an episode reads (| marks the turns, [picture] its image tokens):

    prompt [picture 1]"red circles?" | model "2<eos>" | observation [picture 2]"larger? a circle b square" | model "b<eos>"

What it simplifies: the second scene is drawn from the first's (a seeded stream), so the pair is fixed per row; the
tiny VLM's warm start never saw a picture after an answer, so its second answers start out worse than its first.
`pictures` > 2 chains more scenes. PIL and the reward are imported where used: the workers start without them.
"""
import ast
import random

from registry import register


def next_scene(fields: dict, k: int) -> dict:
    """The k-th scene after a shapes row's own, on the same side of the held-out split: a task=shapes row."""
    from tasks import shapes
    rng = random.Random(f"{fields['scene']}-{k}")
    held = shapes.is_heldout(ast.literal_eval(fields["scene"]))
    while True:
        scene, answer = (shapes.draw_count if rng.random() < 0.5 else shapes.draw_larger)(rng)
        if shapes.is_heldout(scene) == held:
            row = {"prompt": shapes.PROMPTS[scene["kind"]], "image": shapes.png(shapes.render(scene)),
                   "answer": answer}
            return {**row, "choices": "ab"} if scene["kind"] == "larger" else row


@register("env", "shapes_pair")
class ShapesPair:
    def __init__(self, pictures: int = 2):
        if pictures < 1:
            raise ValueError(f"shapes_pair: pictures must be >= 1, got {pictures}")
        self.pictures, self.questions, self.turn, self.right = pictures, [], 0, 0

    def reset(self, fields: dict) -> dict:
        first = {k: fields[k] for k in ("prompt", "image", "answer", "choices") if k in fields}
        self.questions = [first] + [next_scene(fields, k) for k in range(1, self.pictures)]
        self.turn, self.right = 0, 0
        return {"text": first["prompt"], "image": first["image"]}

    def step(self, action: str):
        from rewards.vision import vision_reward
        q = self.questions[self.turn]
        reward = vision_reward(q["prompt"], action, answer=q["answer"], **({"choices": q["choices"]} if "choices" in q
                                                                           else {}))
        self.turn, self.right = self.turn + 1, self.right + int(reward > 0)
        if self.turn == len(self.questions):
            return None, reward, True, {"success": self.right == len(self.questions)}
        nxt = self.questions[self.turn]
        return {"text": nxt["prompt"], "image": nxt["image"]}, reward, False, {}
