"""Generative judge (LLM-as-judge): a causal LM reads a rubric filled with the prompt, the completion and the row's
reference answer, and its reply becomes the score.

    # config: rewards=arithmetic:1.0,judge:0.5  reward_args='judge.path=/models/judge,judge.mode=yes_prob'
    scores = judge(prompts, completions, fields, path="/models/judge", mode="yes_prob")   # list[float]

Three ways to turn the judge's reply into a number (`mode`):
  yes_prob  the probability of the `yes` token as the reply's first token, read from one forward's logits (no
            sampling: the cheapest); with `no` set (default "NO") it is renormalised over the two:
            p(yes) / (p(yes) + p(no)). `min_mass` > 0 makes a judge that puts less than that on the two a failure.
  number    greedy reply; the first number in it is the score, mapped from [lo, hi] onto [0, 1] when both are set
            (a number outside them is a failure).
  verdict   greedy reply; the verdict word that comes first in it is looked up in `verdicts`
            ("CORRECT:1;PARTIAL:0.5;WRONG:0", or a dict from Python).
A reply that gives no score (no number, no verdict, an over-long judge prompt) is a recorded failure: the sample
scores 0 and carries ("error", reason) to the reward pool (rewards/score.py: Score), which counts and logs it.

The template fills {prompt}, {completion} and {reference} (the sample's field named by `reference_field`, default
"answer"); `template_file` reads it from a file (reward_args cannot hold commas). When the tokenizer has a chat
template (and `chat` is not False) the filled rubric is sent as one user message with the generation prompt.
The judge loads once per (path, device) and stays; it runs in eval mode under no_grad, on `device` (default: this
rank's GPU, LOCAL_RANK, when CUDA is there, else the CPU), `batch_size` rubrics at a time, greedy through the
project's built-in engine (engines/builtin.py: BuiltinEngine), its portable loop unless `fast` (see load).
Identical rubrics (same prompt, completion and reference: a GRPO group often repeats an answer) are judged once
per call.
It is a batched reward (`judge.batched = True`): the pool calls it on a thread of the trainer process.
"""
import os
import re
from types import SimpleNamespace

from registry import register
from rewards.score import Score

MODES = ("yes_prob", "number", "verdict")
TEMPLATE = ("Grade the answer to the question against the reference answer.\n"
            "Question: {prompt}\nReference answer: {reference}\nAnswer: {completion}\n"
            "Is the answer correct? Reply YES or NO.\n")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_LOADED: dict = {}


def default_device() -> str:
    import torch
    # the pool calls from its own thread, whose current CUDA device is 0 whatever the rank's is: name it
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def load(path: str, device: str | None = None, dtype: str = "auto", fast: bool = False):
    """-> (model, tokenizer, engine), cached per (path, device, fast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from engines.builtin import BuiltinEngine
    device = device or default_device()
    key = (path, device, fast)
    if key not in _LOADED:
        tok = AutoTokenizer.from_pretrained(path)
        if tok.pad_token is None:                # batching needs padding; EOS is the usual stand-in
            tok.pad_token = tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval().requires_grad_(False)
        # fast: the fast decoder captures a CUDA graph, and a capture from the reward thread while the trainer's
        # thread runs its forwards can make that thread's CUDA calls fail: off unless asked for (then: on CUDA, for
        # the model types engines/fast_decode.py supports)
        engine = BuiltinEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, fast=None if fast else False)
        _LOADED[key] = (model, tok, engine)
    return _LOADED[key]


def parse_verdicts(verdicts) -> dict[str, float]:
    """'CORRECT:1;WRONG:0' or {'CORRECT': 1, 'WRONG': 0} -> {'CORRECT': 1.0, 'WRONG': 0.0}."""
    if isinstance(verdicts, str):
        pairs = [p.rpartition(":") for p in filter(None, (s.strip() for s in verdicts.split(";")))]
        verdicts = {word.strip(): value for word, _, value in pairs}
    try:
        out = {str(k): float(v) for k, v in dict(verdicts).items() if str(k)}
    except (TypeError, ValueError):
        out = {}
    if not out:
        raise ValueError(f"judge: verdicts {verdicts!r} must map words to numbers, e.g. 'CORRECT:1;WRONG:0'")
    return out


def check_args(mode: str, template: str, lo, hi) -> None:
    """Refuse options that cannot work, before the judge loads."""
    if mode not in MODES:
        raise ValueError(f"judge: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if (lo is None) != (hi is None) or (lo is not None and not float(lo) < float(hi)):
        raise ValueError(f"judge: set both lo < hi (or neither) for mode=number, got lo={lo!r} hi={hi!r}")
    try:
        template.format(prompt="", completion="", reference="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"judge: template field {e} is not one of {{prompt}}, {{completion}}, {{reference}} "
                         "(double a literal brace)") from None


def render(tok, template: str, prompt: str, completion: str, reference: str, chat: bool | None) -> str:
    text = template.format(prompt=prompt, completion=completion, reference=reference)
    if chat is not False and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    if chat:
        raise ValueError("judge: chat=true but the judge's tokenizer has no chat template")
    return text


def single_token(tok, text: str, what: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"judge: {what}={text!r} is {len(ids)} tokens for the judge's tokenizer; give one token "
                         "(often with its leading space, e.g. ' YES')")
    return ids[0]


def yes_probs(model, tok, ids: list[list[int]], yes: int, no: int | None, batch_size: int) -> list[tuple[float, float]]:
    """-> (score, p(yes) + p(no)) per rubric, from the next-token distribution after each (one forward, no sampling)."""
    import torch
    from engines.base import left_pad
    from models import position_ids
    out = []
    device = next(model.parameters()).device
    for start in range(0, len(ids), batch_size):
        x, mask = (t.to(device) for t in left_pad(ids[start:start + batch_size], tok.pad_token_id))   # (b, P)
        logits = model(input_ids=x, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -1]  # (b, V)
        p = torch.softmax(logits.float(), dim=-1)                                                       # (b, V)
        p_yes = p[:, yes]
        mass = p_yes + p[:, no] if no is not None else p_yes
        score = p_yes / mass.clamp(min=1e-30) if no is not None else p_yes
        out += list(zip(score.tolist(), mass.tolist()))
    return out


def replies(engine, tok, ids: list[list[int]], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy replies, decoded without special tokens."""
    from engines.base import SamplingParams
    greedy = SamplingParams(temperature=1e-5, max_new_tokens=max_new_tokens)   # the project's greedy (rollout.py: evaluate)
    out = []
    for start in range(0, len(ids), batch_size):
        r = engine.generate(ids[start:start + batch_size], 1, greedy)
        C = r.completion_mask.shape[1]
        for row, n in zip(r.input_ids[:, -C:], r.completion_mask.sum(-1).long()):
            out.append(tok.decode(row[:n].tolist(), skip_special_tokens=True))
    return out


def score_reply(reply: str, mode: str, verdicts: dict[str, float], lo, hi) -> Score:
    """A reply -> its score, or Score(0, [("error", why)]) when it gives none."""
    shown = repr(reply[:80])
    if mode == "number":
        m = NUMBER.search(reply)
        if m is None:
            return Score(0.0, [("error", f"judge reply has no number: {shown}")])
        x = float(m.group())
        if lo is None:
            return Score(x)
        if not float(lo) <= x <= float(hi):
            return Score(0.0, [("error", f"judge score {x:g} outside [{lo}, {hi}]: {shown}")])
        return Score((x - float(lo)) / (float(hi) - float(lo)))
    found = [(m.start(), word) for word in verdicts
             for m in [re.search(rf"(?<!\w){re.escape(word)}(?!\w)", reply, re.IGNORECASE)] if m]
    if not found:
        return Score(0.0, [("error", f"judge reply has no verdict of {'/'.join(verdicts)}: {shown}")])
    start = min(s for s, _ in found)                    # the first verdict; at a tie the longest word ("NOT OK")
    return Score(verdicts[max((w for s, w in found if s == start), key=len)])


def judge_unique(texts: list[str], model, tok, engine, o) -> list[Score]:
    """Distinct rubric texts -> one Score each; o: the judge's options (mode, yes, no, min_mass, verdicts, lo, hi,
    reply_tokens, max_length, batch_size)."""
    import torch
    ids = [tok(t, add_special_tokens=not getattr(tok, "chat_template", None)).input_ids for t in texts]
    fit = [i for i, x in enumerate(ids) if len(x) <= o.max_length]
    out = [Score(0.0, [("error", f"judge prompt of {len(x)} tokens is over max_length={o.max_length}")])
           for x in ids]
    with torch.no_grad():
        if o.mode == "yes_prob":
            no_id = single_token(tok, o.no, "no") if o.no else None
            probs = yes_probs(model, tok, [ids[i] for i in fit], single_token(tok, o.yes, "yes"), no_id, o.batch_size)
            for i, (score, mass) in zip(fit, probs):
                out[i] = Score(score) if mass >= o.min_mass else Score(
                    0.0, [("error", f"judge puts {mass:.3g} < min_mass={o.min_mass:g} on {o.yes!r}/{o.no!r}")])
        else:
            for i, reply in zip(fit, replies(engine, tok, [ids[i] for i in fit], o.reply_tokens, o.batch_size)):
                out[i] = score_reply(reply, o.mode, o.verdicts, o.lo, o.hi)
    return out


@register("reward", "judge")
def judge(prompts: list[str], completions: list[str], fields: list[dict] | None = None, *, path: str = "",
          mode: str = "yes_prob", template: str = TEMPLATE, template_file: str = "", chat: bool | None = None,
          reference_field: str = "answer", yes: str = "YES", no: str = "NO", min_mass: float = 0.0,
          verdicts="YES:1;NO:0", lo=None, hi=None, reply_tokens: int = 16, max_length: int = 4096,
          batch_size: int = 16, device: str | None = None, dtype: str = "auto", fast: bool = False) -> list[Score]:
    # the reply's length is reply_tokens, not max_new_tokens: a reward naming max_new_tokens gets the rollout's
    # (rewards/pool.py SAMPLING_ARGS)
    if not path:
        raise ValueError("judge: set args {path: <folder of a causal LM>} (reward_args='judge.path=/x')")
    if template_file:
        with open(template_file) as f:
            template = f.read()
    check_args(mode, template, lo, hi)
    o = SimpleNamespace(mode=mode, yes=yes, no=no, min_mass=min_mass, lo=lo, hi=hi, reply_tokens=reply_tokens,
                        max_length=max_length, batch_size=batch_size,
                        verdicts=parse_verdicts(verdicts) if mode == "verdict" else {})
    fields = fields if fields is not None else [{} for _ in prompts]
    model, tok, engine = load(path, device, dtype, fast)
    texts = [render(tok, template, p, c, str(f.get(reference_field, "")), chat)
             for p, c, f in zip(prompts, completions, fields)]
    unique = list(dict.fromkeys(texts))                 # first-seen order; a repeated rubric is judged once
    scores = dict(zip(unique, judge_unique(unique, model, tok, engine, o)))
    return [scores[t] for t in texts]


judge.batched = True
