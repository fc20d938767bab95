"""Learned reward: score (prompt, completion) with a sequence-classification model from a local folder.

    # config: rewards=math:1.0,reward_model:0.5  with the reward's args {"path": "/models/my-rm"}
    scores = reward_model(prompts, completions, fields, path="/models/my-rm", batch_size=16)  # list[float]

Any transformers `AutoModelForSequenceClassification` folder works (the head's first logit is the reward,
as for Skywork/ArmoRM-style single-output reward models). When the tokenizer has a chat template the
pair is rendered as a user/assistant conversation with it, otherwise as prompt + completion. The
model is loaded once per (path, device) and kept; it runs in eval mode under no_grad, `batch_size`
samples at a time, right-truncated to `max_length` tokens.
It is a *batched* reward (`reward_model.batched = True`): the reward pool calls it once per batch on a
thread of the trainer process, where the GPU is, rather than once per sample in a worker process.
"""
from registry import register

_LOADED: dict = {}


def load(path: str, device: str | None = None, dtype: str = "auto"):
    """-> (model, tokenizer), cached. device None: cuda if available else cpu."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    key = (path, device)
    if key not in _LOADED:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device).eval()
        if tok.pad_token is None:                # batching needs padding; EOS is the usual stand-in
            tok.pad_token = tok.eos_token
        if model.config.pad_token_id is None:    # the head reads the last non-pad token
            model.config.pad_token_id = tok.pad_token_id
        _LOADED[key] = (model, tok)
    return _LOADED[key]


def render(tok, prompt: str, completion: str) -> str:
    if getattr(tok, "chat_template", None):
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return tok.apply_chat_template(chat, tokenize=False)
    return prompt + completion


@register("reward", "reward_model")
def reward_model(prompts: list[str], completions: list[str], fields: list[dict] | None = None, *,
                 path: str = "", batch_size: int = 8, max_length: int = 2048, device: str | None = None) -> list[float]:
    import torch
    if not path:
        raise ValueError("reward_model: set args {path: <folder of a sequence-classification model>}")
    model, tok = load(path, device)
    texts = [render(tok, p, c) for p, c in zip(prompts, completions)]
    scores = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            enc = tok(texts[start:start + batch_size], return_tensors="pt", padding=True, truncation=True,
                      max_length=max_length, add_special_tokens=not getattr(tok, "chat_template", None))
            logits = model(**enc.to(model.device)).logits      # (b, num_labels)
            scores += logits[:, 0].float().cpu().tolist()
    return scores


reward_model.batched = True
