"""Prompts from files (task "files"), the task data processor, and the experience data processor.

    python train.py --config configs/gsm8k.yaml          # task: files, settings in the `files:` section
    from data_files import DataFilesConfig, files_task
    train, held_out = files_task(DataFilesConfig(train_path="gsm8k/train.parquet", eval_path="gsm8k/test.parquet"))
    train[0]   # {"prompt": "...rendered prompt...", "answer": "72", ...extra fields for the rewards}

Sources: .jsonl, .json (a list of objects), .parquet (pyarrow), or a folder written by
`datasets.Dataset.save_to_disk` (a DatasetDict folder gives its `split` / `eval_split`). A path may be
a glob ("data/train-*.parquet"); the matches are read in sorted order and concatenated.

Task data processor (`process_tasks`), in this order:
  1. field mapping: the sample's "prompt" is `prompt_field`, "answer" is `answer_field` (cut by the first
     group of `answer_regex` if given, e.g. GSM8K's "####\\s*(.+)"), `fields` adds more ("tests:test_cases");
  2. rendering: `prompt_template` ("{prompt}" is the mapped text), then the chat template of the tokenizer
     in `chat_template` (a model folder) with `system_prompt`, ending with the generation prompt. A
     rendered prompt already holds the template's special tokens: tokenize it with add_special_tokens=False;
  3. dedupe (on by default): repeated prompts keep their first row, and training rows whose prompt is
     also an evaluation prompt are dropped (no training on the held-out set);
  4. length filter: rendered prompts longer than `max_prompt_chars` characters or `max_prompt_tokens`
     tokens are dropped;
  5. shuffle with `seed`, then keep the first `limit` rows (0 = all).
With no eval_path, the last `eval_size` rows of the shuffled train set are held out.

Experience data processor (pure functions over a scored batch, used by the training loop):
  groups_with_signal(rewards, group_ids) -> keep mask (B,): False for groups whose rewards are all equal
      (zero advantage under group normalisation: "dynamic sampling", DAPO)
  mask_truncated(exp) -> Experience whose truncated samples have a zeroed completion_mask ("overlong
      filtering", DAPO: they stay in their group's statistics but contribute no gradient)
  dynamic_sampling(sample_groups, n_groups, group_size, max_rounds) -> (Experience, stats): calls
      sample_groups(k) for k more groups until n_groups with signal are collected (or max_rounds pass)
"""
import glob
import json
import os
import random
import re
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from buffer import Experience
from registry import register


@dataclass
class DataFilesConfig:
    train_path: str = field(default="", metadata={"help": ".jsonl/.json/.parquet file, glob, or datasets.save_to_disk folder"})
    eval_path: str = field(default="", metadata={"help": "held-out prompts, same kinds ('' = hold out eval_size train rows)"})
    split: str = field(default="train", metadata={"help": "split of a DatasetDict folder used for training"})
    eval_split: str = field(default="test", metadata={"help": "split of a DatasetDict folder used for evaluation"})
    eval_size: int = field(default=200, metadata={"help": "rows held out from train when there is no eval_path"})
    prompt_field: str = field(default="question", metadata={"help": "column holding the prompt text"})
    answer_field: str = field(default="answer", metadata={"help": "column given to rewards as 'answer' ('' = none)"})
    answer_regex: str = field(default="", metadata={"help": "keep the first group of this regex in the answer, e.g. '####\\s*(.+)'"})
    fields: str = field(default="", metadata={"help": "extra sample fields for rewards: 'name:column,name:column'"})
    prompt_template: str = field(default="{prompt}", metadata={"help": "Python format string; {prompt} is the prompt column"})
    system_prompt: str = field(default="", metadata={"help": "system message when a chat template is applied"})
    chat_template: str = field(default="", metadata={"help": "model/tokenizer folder whose chat template renders prompts ('' = none)"})
    max_prompt_chars: int = field(default=0, metadata={"help": "drop rendered prompts longer than this (0 = no limit)"})
    max_prompt_tokens: int = field(default=0, metadata={"help": "drop prompts longer than this in tokens (needs chat_template)"})
    dedupe: bool = field(default=True, metadata={"help": "drop repeated prompts and train prompts that are also eval prompts"})
    seed: int = field(default=0, metadata={"help": "shuffle seed"})
    limit: int = field(default=0, metadata={"help": "keep at most this many training prompts (0 = all)"})


# ----------------------------------------------------------------------------------------- reading

def read_rows(path: str, split: str = "train") -> list[dict]:
    """Rows of a .jsonl / .json / .parquet file, a glob of them, or a datasets.save_to_disk folder."""
    if any(c in path for c in "*?["):
        matches = sorted(glob.glob(path))
        if not matches:
            raise FileNotFoundError(f"no file matches {path!r}")
        return [row for m in matches for row in read_rows(m, split)]
    if os.path.isdir(path):
        import datasets
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{path} has splits {sorted(ds)}, not {split!r}")
            ds = ds[split]
        return ds.to_list()
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such data file: {path}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        return rows
    if path.endswith(".json"):
        with open(path) as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of objects")
        return rows
    raise ValueError(f"{path}: unsupported data file (use .jsonl, .json, .parquet or a datasets folder)")


# ------------------------------------------------------------------------------ task data processor

def parse_fields(spec: str) -> list[tuple[str, str]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, column = part.partition(":")
        if not sep or not name.strip() or not column.strip():
            raise ValueError(f"files.fields entry {part!r} must look like name:column")
        out.append((name.strip(), column.strip()))
    return out


def map_row(row: dict, cfg: DataFilesConfig, where: str) -> dict:
    """One source row -> a sample {"prompt": unrendered text, "answer": ..., extra fields}."""
    def column(name):
        if name not in row:
            raise ValueError(f"{where} has no field {name!r} (it has: {', '.join(map(str, row))})")
        return row[name]
    sample = {"prompt": str(column(cfg.prompt_field))}
    if cfg.answer_field:
        answer = column(cfg.answer_field)
        if cfg.answer_regex:
            m = re.search(cfg.answer_regex, str(answer), re.DOTALL)
            if not m:
                raise ValueError(f"{where}: answer {str(answer)[-60:]!r} does not match answer_regex {cfg.answer_regex!r}")
            answer = m.group(1).strip()
        sample["answer"] = answer
    for name, col in parse_fields(cfg.fields):
        sample[name] = column(col)
    return sample


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"files.chat_template: the tokenizer in {path} has no chat template")
    return tok


def render(prompt: str, cfg: DataFilesConfig, tok=None) -> str:
    text = cfg.prompt_template.format(prompt=prompt)
    if tok is None:
        return text
    messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + \
               [{"role": "user", "content": text}]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _key(prompt: str) -> str:
    return " ".join(prompt.split()).casefold()


def process_tasks(rows: list[dict], cfg: DataFilesConfig, where: str, tok=None, exclude: set | None = None,
                  shuffle: bool = True) -> tuple[list[dict], dict]:
    """Map, render, dedupe, length-filter and shuffle rows -> (samples, counts of what was dropped)."""
    stats = {"rows": len(rows), "duplicates": 0, "in_eval": 0, "too_long": 0}
    seen, out = set(), []
    for n, row in enumerate(rows):
        sample = map_row(row, cfg, f"{where} row {n}")
        key = _key(sample["prompt"])
        if cfg.dedupe and key in seen:
            stats["duplicates"] += 1
            continue
        if cfg.dedupe and exclude and key in exclude:
            stats["in_eval"] += 1
            continue
        seen.add(key)
        sample["prompt"] = render(sample["prompt"], cfg, tok)
        if tok is not None:
            sample["chat_rendered"] = True       # the loop must not apply a chat template a second time
        too_long = (cfg.max_prompt_chars and len(sample["prompt"]) > cfg.max_prompt_chars) or \
                   (cfg.max_prompt_tokens and len(tok(sample["prompt"], add_special_tokens=False)["input_ids"]) > cfg.max_prompt_tokens)
        if too_long:
            stats["too_long"] += 1
            continue
        out.append(sample)
    if shuffle:
        random.Random(cfg.seed).shuffle(out)
    stats["kept"] = len(out)
    return out, stats


@register("task", "files")
def files_task(cfg: DataFilesConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval) samples from files; see the module docstring for the processing steps."""
    if not cfg.train_path:
        raise ValueError("files.train_path is empty: point it at a .jsonl/.json/.parquet file or a datasets folder")
    if cfg.max_prompt_tokens and not cfg.chat_template:
        raise ValueError("files.max_prompt_tokens needs files.chat_template (the tokenizer that counts tokens)")
    tok = load_tokenizer(cfg.chat_template) if cfg.chat_template else None
    eval_rows = []
    if cfg.eval_path:
        eval_rows = read_rows(cfg.eval_path, cfg.eval_split)
    elif os.path.isdir(cfg.train_path) and os.path.exists(os.path.join(cfg.train_path, "dataset_dict.json")):
        with open(os.path.join(cfg.train_path, "dataset_dict.json")) as f:
            if cfg.eval_split in json.load(f).get("splits", []):
                eval_rows = read_rows(cfg.train_path, cfg.eval_split)
    evals, _ = process_tasks(eval_rows, cfg, cfg.eval_path or cfg.train_path, tok, shuffle=False)
    exclude = {_key(map_row(r, cfg, "eval")["prompt"]) for r in eval_rows}
    train, stats = process_tasks(read_rows(cfg.train_path, cfg.split), cfg, cfg.train_path, tok, exclude)
    if not eval_rows:
        if len(train) <= cfg.eval_size:
            raise ValueError(f"{cfg.train_path}: {len(train)} prompts cannot spare eval_size={cfg.eval_size} for evaluation")
        train, evals = train[:len(train) - cfg.eval_size], train[len(train) - cfg.eval_size:]
    if cfg.limit:
        train = train[:cfg.limit]
    print(f"task files: {len(train)} train / {len(evals)} eval prompts "
          f"(dropped {stats['duplicates']} duplicates, {stats['in_eval']} eval prompts, {stats['too_long']} too long)")
    return train, evals


# ------------------------------------------------------------------------ experience data processor

def groups_with_signal(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """Keep mask (B,): True for samples whose group's rewards are not all equal (spread > eps)."""
    ids = torch.unique(group_ids, return_inverse=True)[1]                    # (B,) groups numbered 0..G-1
    G = int(ids.max()) + 1 if len(ids) else 0
    r = rewards.float()
    hi = torch.full((G,), -torch.inf).scatter_reduce(0, ids, r, "amax")      # (G,)
    lo = torch.full((G,), torch.inf).scatter_reduce(0, ids, r, "amin")       # (G,)
    return (hi - lo > eps)[ids]                                              # (B,)


def mask_truncated(exp: Experience) -> Experience:
    """Zero the completion_mask of samples that hit the length limit (they keep their reward and group)."""
    keep = (~exp.truncated).to(exp.completion_mask.dtype)[:, None]           # (B, 1)
    return replace(exp, completion_mask=exp.completion_mask * keep)          # (B, C)


def dynamic_sampling(sample_groups, n_groups: int, group_size: int, max_rounds: int = 4,
                     truncated: bool = True) -> tuple[Experience, dict]:
    """Collect n_groups prompt groups whose rewards vary, sampling more until full or max_rounds.

    sample_groups(k) -> Experience of k scored groups (k * group_size rows, a group's rows adjacent).
    truncated=False applies mask_truncated first. The result may hold fewer than n_groups groups
    (even none) when max_rounds run out: stats["groups"] says how many; the caller decides to skip.
    """
    if max_rounds < 1 or n_groups < 1:
        raise ValueError(f"dynamic_sampling: max_rounds and n_groups must be >= 1, got {max_rounds}, {n_groups}")
    kept, have, drawn = [], 0, 0
    for _ in range(max_rounds):
        if have >= n_groups:
            break
        exp = sample_groups(n_groups - have)
        drawn += len(exp) // group_size
        if not truncated:
            exp = mask_truncated(exp)
        rows = groups_with_signal(exp.rewards, exp.group_ids).nonzero().squeeze(1)   # (b,)
        rows = rows[:(n_groups - have) * group_size]
        if len(rows):
            kept.append(exp.select(rows))
            have += len(rows) // group_size
    if not kept:
        return exp.select(torch.arange(0)), {"groups": 0, "groups_drawn": drawn}
    out = Experience.cat(kept)
    out.group_ids = torch.arange(len(out)) // group_size                     # (B,) renumbered across rounds
    return out, {"groups": have, "groups_drawn": drawn}
