"""run_dir.Logger: metrics.jsonl and its sinks (tensorboard, wandb in offline mode) hold the same rows under the
same names, and an evaluation's completions as a table."""
import glob
import json
import os
import struct

import pytest
import yaml

import run_dir
from config import UserError

ROWS = [{"step": 0, "eval/accuracy": 0.25, "eval/reward": 0.5},
        {"step": 1, "reward": 0.75, "loss": -0.125, "time/update": 0.5, "reward_fail/math/timeout": 2.0},
        {"step": 2, "reward": 1.0, "loss": 0.25, "eval/accuracy": 0.5, "eval/reward": 1.0}]
SAMPLES = [{"prompt": "12+30=", "completion": "42", "reward": 1.0},
           {"prompt": "a|b", "completion": "line\nbreak", "reward": 0.0}]   # a pipe and a newline: one table row each


def log_rows(out, sinks):
    logger = run_dir.Logger(str(out), first_step=1, resume=False, sinks=sinks)
    for row in ROWS:
        logger.log(row, SAMPLES if "eval/accuracy" in row else None)
    logger.close()


def test_tensorboard_tags_are_the_metric_keys(tmp_path):
    """One rule for every key, with or without a '/': the tag is the metrics.jsonl key."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log_rows(tmp_path, "tensorboard")
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ROWS
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    keys = {k for row in ROWS for k in row if k != "step"}
    assert set(events.Tags()["scalars"]) == keys
    for key in keys:
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(row["step"], pytest.approx(row[key])) for row in ROWS if key in row], key
    texts = events.Tensors("eval/samples/text_summary")   # add_text's tag
    assert [e.step for e in texts] == [0, 2]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert "| 12+30= | 42 | 1.0 |" in table and "a\\|b" in table and "line\\nbreak" in table
    assert len(table.splitlines()) == 2 + len(SAMPLES)


def read_wandb_records(path: str) -> list:
    """The records of a .wandb file: a 7-byte header, then LevelDB log records (7-byte headers: crc, length, type;
    32 KiB blocks, a block's tail shorter than a header is padding; types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2
    data, pos, part, records = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(part))
            part = b""
    return records


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb offline, every file of it under the test's folder (monkeypatch restores the variables)."""
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)


def test_wandb_offline_run_holds_config_rows_and_samples(tmp_path, wandb_offline):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump({"algo": {"name": "grpo"}, "lr": 0.0001}))
    log_rows(out, "tensorboard,wandb")
    import wandb
    wandb.teardown()   # the wandb service writes the run file on its own; at its exit (a script's) every record is in
    run_id = (out / "wandb" / "run_id").read_text()
    [path] = glob.glob(str(out / "wandb" / "offline-run-*" / f"run-{run_id}.wandb"))
    records = read_wandb_records(path)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [{k: v for k, v in h.items() if not k.startswith("_") and not k.startswith("eval/samples")}
            for h in history] == [{k: v for k, v in row.items() if k != "step"} for row in ROWS]
    assert [h["_step"] for h in history] == [0, 1, 2]
    config = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "run"
              for i in r.run.config.update}
    assert config["algo"] == {"name": "grpo"} and config["lr"] == 0.0001
    tables = [h for h in history if "eval/samples/path" in h]
    assert len(tables) == 2                                            # one table per evaluation
    with open(os.path.join(os.path.dirname(path), "files", tables[-1]["eval/samples/path"])) as f:
        table = json.load(f)
    assert table["columns"] == ["prompt", "completion", "reward"]
    assert table["data"] == [[s["prompt"], s["completion"], s["reward"]] for s in SAMPLES]
    assert (out / "metrics.jsonl").exists() and list(out.glob("events.out.tfevents*"))   # both sinks at once


def test_bad_logger_is_one_line_error(monkeypatch):
    with pytest.raises(UserError, match="'logger' takes a comma list of tensorboard, wandb .*'mlflow'"):
        run_dir.Logger.check("tensorboard,mlflow")
    real = run_dir.importlib.util.find_spec
    monkeypatch.setattr(run_dir.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match="pip install wandb") as e:
        run_dir.Logger.check("wandb")
    assert "\n" not in str(e.value)
    assert run_dir.Logger.check("") == [] and run_dir.Logger.check(" tensorboard ") == ["tensorboard"]


def test_train_logs_each_evaluations_completions(tmp_path, random_model_dir):
    """train.py hands each evaluation's greedy completions to the Logger: a table at steps 0 and 2, none at 1."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import train_here
    train_here([f"model={random_model_dir}", "steps=2", "eval_every=2", "eval_size=3", "prompts_per_step=2",
                "samples_per_prompt=2", "threads=1", "progress=false", f"out_dir={tmp_path / 'run'}"])
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("eval/samples/text_summary")
    assert [e.step for e in texts] == [0, 2]
    table = texts[-1].tensor_proto.string_val[0].decode().splitlines()
    assert table[0] == "| prompt | completion | reward |" and len(table) == 2 + 3   # the 3 held-out prompts
    assert "reward" in events.Tags()["scalars"] and "eval/accuracy" in events.Tags()["scalars"]
