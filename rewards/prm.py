"""Process reward model: a sequence-classification model scores every step of a completion (a per-step reward).

    # config: rewards=arithmetic:1.0,prm:0.5  reward_args='prm.path=/models/my-prm'
    scores = prm(prompts, completions, fields, path="/models/my-prm")   # [[step scores] per sample]

The completion is cut into steps as the reward pool counts them (rewards/score.py: step_ends; a line each unless
the row's `step_separator` field names another separator), and step k's score is the classifier's on the prompt
followed by steps 1..k: the head reads the last token, so each prefix is judged as an answer that stops at that
step (Math-Shepherd and PRM800K-style PRMs are trained on such prefixes). `label=-1` (default) takes the head's
first logit, as reward_model does; `label=k` the softmax probability of class k (a PRM with good/bad classes).
The model is rewards/reward_model.py's (loaded once per (path, device), eval mode, no gradients, `batch_size`
prefixes at a time, right-truncated to `max_length` tokens). Batched, so it runs on a thread of the trainer.
The pool turns the lists into per-token rewards (docs/rewards.md: process rewards).
"""
from registry import register
from rewards.reward_model import load, render
from rewards.score import split_steps, step_separator


def prefixes(completion: str, sep: str) -> list[str]:
    """The completion up to and including each of its steps (the last is the whole completion)."""
    steps = split_steps(completion, sep)
    return ["".join(steps[:k + 1]) for k in range(len(steps))]


@register("reward", "prm")
def prm(prompts: list[str], completions: list[str], fields: list[dict] | None = None, *, path: str = "",
        label: int = -1, batch_size: int = 8, max_length: int = 2048, device: str | None = None) -> list[list[float]]:
    import torch
    if not path:
        raise ValueError("prm: set args {path: <folder of a sequence-classification model>}")
    model, tok = load(path, device)
    fields = fields or [{} for _ in prompts]
    cuts = [prefixes(c, step_separator(f, prm)) for c, f in zip(completions, fields)]
    texts = [render(tok, p, part) for p, parts in zip(prompts, cuts) for part in parts]
    flat = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            enc = tok(texts[start:start + batch_size], return_tensors="pt", padding=True, truncation=True,
                      max_length=max_length, add_special_tokens=not getattr(tok, "chat_template", None))
            logits = model(**enc.to(model.device)).logits.float()                  # (b, num_labels)
            flat += (logits[:, 0] if label < 0 else logits.softmax(-1)[:, label]).cpu().tolist()
    out, at = [], 0
    for parts in cuts:          # back into one list of step scores per sample
        out.append(flat[at:at + len(parts)])
        at += len(parts)
    return out


prm.batched = True
