"""File-based prompts (jsonl, json, parquet, datasets folders) and the task processor."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks.files import DataFilesConfig  # noqa: E402
from tasks.files import files_task, read_rows  # noqa: E402

GSM = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many apples?",
        "answer": f"He has {i} + {i + 1} = {2 * i + 1} apples.\n#### {2 * i + 1}"} for i in range(30)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg(**kw):
    base = dict(answer_regex=r"####\s*(.+)", eval_size=5)
    return DataFilesConfig(**{**base, **kw})


def test_every_source_kind_reads_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    jsonl = write_jsonl(tmp_path / "a.jsonl", GSM)
    (tmp_path / "a.json").write_text(json.dumps(GSM))
    pq.write_table(pa.Table.from_pylist(GSM), tmp_path / "a.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM[:20]),
                          "test": datasets.Dataset.from_list(GSM[20:])}).save_to_disk(tmp_path / "dd")
    pq.write_table(pa.Table.from_pylist(GSM[:10]), tmp_path / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(GSM[10:]), tmp_path / "part-1.parquet")
    for path in (jsonl, str(tmp_path / "a.json"), str(tmp_path / "a.parquet"), str(tmp_path / "part-*.parquet")):
        assert read_rows(path) == GSM, path
    assert read_rows(str(tmp_path / "dd")) == GSM[:20] and read_rows(str(tmp_path / "dd"), "test") == GSM[20:]
    # a DatasetDict folder supplies its own eval split, and answers are cut by the regex
    train, evals = files_task(cfg(train_path=str(tmp_path / "dd")))
    assert len(train) == 20 and len(evals) == 10
    assert evals[0] == {"prompt": GSM[20]["question"], "answer": "41"}


def test_bad_inputs_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        read_rows(str(bad))
    with pytest.raises(FileNotFoundError, match="no such data file"):
        read_rows(str(tmp_path / "missing.jsonl"))
    path = write_jsonl(tmp_path / "a.jsonl", GSM)
    with pytest.raises(ValueError, match="row 0 has no field 'problem' \\(it has: question, answer\\)"):
        files_task(cfg(train_path=path, prompt_field="problem"))
    with pytest.raises(ValueError, match="does not match answer_regex"):
        files_task(cfg(train_path=path, answer_regex=r"ANSWER: (\d+)"))
    with pytest.raises(ValueError, match="must look like name:column"):
        files_task(cfg(train_path=path, fields="tests"))
    with pytest.raises(ValueError, match="train_path is empty"):
        files_task(DataFilesConfig())


def test_dedupe_decontamination_length_filter_and_seeded_shuffle(tmp_path):
    rows = GSM + [dict(GSM[3]), {"question": "  " + GSM[4]["question"].upper(), "answer": "#### 9"},
                  {"question": "x" * 500, "answer": "#### 1"}]
    train_path = write_jsonl(tmp_path / "train.jsonl", rows)
    eval_path = write_jsonl(tmp_path / "test.jsonl", GSM[25:])
    train, evals = files_task(cfg(train_path=train_path, eval_path=eval_path, max_prompt_chars=200))
    prompts = [s["prompt"] for s in train]
    assert len(evals) == 5 and len(train) == 25             # 33 rows - 2 duplicates - 5 in eval - 1 too long
    assert len(set(prompts)) == 25 and not set(prompts) & {s["prompt"] for s in evals}
    again, _ = files_task(cfg(train_path=train_path, eval_path=eval_path, max_prompt_chars=200))
    other, _ = files_task(cfg(train_path=train_path, eval_path=eval_path, max_prompt_chars=200, seed=1))
    assert again == train and other != train and sorted(map(str, other)) == sorted(map(str, train))
    kept_all, _ = files_task(cfg(train_path=train_path, eval_path=eval_path, dedupe=False))
    assert len(kept_all) == 33
    limited, _ = files_task(cfg(train_path=train_path, eval_path=eval_path, limit=7))
    assert limited == files_task(cfg(train_path=train_path, eval_path=eval_path))[0][:7]


def test_field_mapping_template_and_held_out_rows(tmp_path):
    rows = [{"problem": f"p{i}", "sol": str(i), "cases": [{"input": "", "output": str(i)}]} for i in range(12)]
    path = write_jsonl(tmp_path / "code.jsonl", rows)
    train, evals = files_task(DataFilesConfig(train_path=path, prompt_field="problem", answer_field="sol",
                                              fields="tests:cases", prompt_template="Solve: {prompt}", eval_size=4))
    assert len(train) == 8 and len(evals) == 4
    s = (train + evals)[0]
    i = int(s["answer"])
    assert s == {"prompt": f"Solve: p{i}", "answer": str(i), "tests": [{"input": "", "output": str(i)}]}


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return str(path)


def test_chat_template_and_token_length_filter(tmp_path, chat_tokenizer_dir):
    rows = [{"question": "short one", "answer": "#### 1"}, {"question": "a b c d e f g h i j k l", "answer": "#### 2"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    eval_path = write_jsonl(tmp_path / "e.jsonl", rows[:1])
    c = cfg(train_path=path, eval_path=eval_path, chat_template=chat_tokenizer_dir, system_prompt="Be brief.",
            prompt_template="{prompt} Answer in \\boxed{{}}.", dedupe=False)
    train, evals = files_task(c)
    assert evals[0]["prompt"] == "<|system|>Be brief.\n<|user|>short one Answer in \\boxed{}.\n<|assistant|>"
    assert len(train) == 2
    c.max_prompt_tokens = 20      # rendered: 19 tokens for the short question, 29 for the long one
    assert [s["answer"] for s in files_task(c)[0]] == ["1"]
    with pytest.raises(ValueError, match="needs files.chat_template"):
        files_task(cfg(train_path=path, eval_path=eval_path, max_prompt_tokens=10))


def test_registered_as_task_files():
    import registry
    assert registry._REGISTRY["task"]["files"] is files_task


# ------------------------------------------------------------------------ experience processor

def test_gsm8k_recipe_config_loads_and_renders(tmp_path):
    """configs/gsm8k.yaml maps onto the trainer's config and turns GSM8K rows into math-reward samples."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    import config
    from rewards.math import math_reward
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "configs", "gsm8k.yaml")) as f:
        raw = yaml.safe_load(f)
    files = raw.pop("files") if not hasattr(config.Config(), "files") else raw["files"]
    main = config.apply(config.Config(), raw)
    assert main.task == "files" and main.rewards == "math:1.0"
    c = config.apply(DataFilesConfig(), files)
    (tmp_path / "main").mkdir()
    pq.write_table(pa.Table.from_pylist(GSM[:20]), tmp_path / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(GSM[20:]), tmp_path / "main" / "test-00000-of-00001.parquet")
    c.train_path = str(tmp_path / c.train_path.split("gsm8k/")[1])
    c.eval_path = str(tmp_path / c.eval_path.split("gsm8k/")[1])
    train, evals = files_task(c)
    assert len(train) == 20 and len(evals) == 10
    s = evals[0]
    assert s["prompt"] == GSM[20]["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert s["answer"] == "41"
    assert math_reward(s["prompt"], "20 + 21 = 41, so \\boxed{41}", **{k: v for k, v in s.items() if k != "prompt"}) == 1.0
