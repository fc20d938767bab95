"""Prompts from files (task "files") and the task data processor.

    python train.py --config configs/gsm8k.yaml          # task: files, settings in the `files:` section
    from tasks.files import DataFilesConfig, files_task
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

"""
import glob
import json
import os
import random
import re
from dataclasses import dataclass

from config import UserError, opt, section
from registry import register


@section("files", "settings of the file-based task (task=files: jsonl, parquet, HF folder)")
@dataclass
class DataFilesConfig:
    train_path: str = opt("", ".jsonl/.json/.parquet file, glob, or datasets.save_to_disk folder")
    eval_path: str = opt("", "held-out prompts, same kinds ('' = hold out eval_size train rows)")
    split: str = opt("train", "split of a DatasetDict folder used for training")
    eval_split: str = opt("test", "split of a DatasetDict folder used for evaluation")
    eval_size: int = opt(200, "rows held out from train when there is no eval_path")
    prompt_field: str = opt("question", "column holding the prompt text")
    answer_field: str = opt("answer", "column given to rewards as 'answer' ('' = none)")
    answer_regex: str = opt("", "keep the first group of this regex in the answer, e.g. '####\\s*(.+)'")
    fields: str = opt("", "extra sample fields for rewards: 'name:column,name:column'")
    prompt_template: str = opt("{prompt}", "Python format string; {prompt} is the prompt column")
    system_prompt: str = opt("", "system message when a chat template is applied")
    chat_template: str = opt("", "model/tokenizer folder whose chat template renders prompts ('' = none)")
    max_prompt_chars: int = opt(0, "drop rendered prompts longer than this (0 = no limit)")
    max_prompt_tokens: int = opt(0, "drop prompts longer than this in tokens (needs chat_template)")
    dedupe: bool = opt(True, "drop repeated prompts and train prompts that are also eval prompts")
    seed: int = opt(0, "shuffle seed")
    limit: int = opt(0, "keep at most this many training prompts (0 = all)")

    def check(self, cfg) -> list:
        """The template and the regex, before a file is read."""
        if cfg.task == "files":
            check_template(self.prompt_template)
            check_regex(self.answer_regex)
        return []


def check_template(template: str):
    try:
        template.format(prompt="")
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(f"config key 'files.prompt_template' must be a format string whose only field is {{prompt}} "
                        f"(write {{{{ and }}}} for braces); {template!r} fails: {type(e).__name__} {e}")


def check_regex(regex: str):
    if not regex:
        return
    try:
        groups = re.compile(regex).groups
    except re.error as e:
        raise UserError(f"config key 'files.answer_regex' is not a regular expression: {e}; got {regex!r}")
    if not groups:
        raise UserError(f"config key 'files.answer_regex' needs a group, (...), around the answer; got {regex!r}")


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
    if not isinstance(row, dict):
        raise ValueError(f"{where} is {type(row).__name__} {str(row)[:40]!r}, not an object with named fields")
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

