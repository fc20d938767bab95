"""The trajectory viewer: run_dir.log_trajectories keeps a bounded sample per step, tools/view.py turns it into one
static page, and headless Chromium renders its rows; hostile completion text stays text."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import run_dir
from buffer import Experience

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTILE = ["</script><script>document.title='pwned'</script>", "<img src=x onerror=\"document.title='pwned'\">",
           "&amp;", "\u2028", "<!--", "ok"]


class Tok:
    """A tokenizer whose tokens are hostile strings: id i decodes to HOSTILE[i % len(HOSTILE)]."""
    def decode(self, ids):
        return "".join(HOSTILE[i % len(HOSTILE)] for i in ids)

    def batch_decode(self, seqs):
        return [self.decode(s) for s in seqs]


def episode_batch(B: int = 6, P: int = 3, C: int = 8, step_shift: float = 0.0) -> Experience:
    """B samples; the odd ones multi-turn (a model turn, an observation, a model turn), then padding."""
    ids = torch.arange(B * (P + C)).view(B, P + C) % len(HOSTILE)
    attn = torch.ones(B, P + C, dtype=torch.long)
    attn[:, -2:] = 0
    cmask = attn[:, P:].float().clone()
    cmask[1::2, 2:4] = 0                                                          # observations
    g = torch.Generator().manual_seed(0)
    rewards = torch.arange(B).float() / B + step_shift
    return Experience(input_ids=ids, attention_mask=attn, completion_mask=cmask,
                      sample_logprobs=-torch.rand(B, C, generator=g) * cmask, rewards=rewards,
                      group_ids=torch.arange(B) // 2, versions=torch.zeros(B, dtype=torch.long),
                      truncated=torch.zeros(B, dtype=torch.bool), advantages=(rewards - rewards.mean())[:, None] * cmask,
                      old_logprobs=-torch.rand(B, C, generator=g) * cmask, turn_rewards=cmask * 0.5)


def fake_run(path, steps: int = 3) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.yaml"), "w") as f:
        f.write("rewards: exact:1.0\n")
    for step in range(1, steps + 1):
        info = {"per_reward": {"exact": torch.arange(6).float()},
                "failed": [{"reward": "exact", "sample": 5, "category": "error", "reason": HOSTILE[0] + HOSTILE[1]}]}
        run_dir.log_trajectories(str(path), step, episode_batch(step_shift=step), Tok(), info,
                                 "hostile" if step % 2 else "echo")
    return str(path)


def test_log_is_a_bounded_spread_of_each_step(tmp_path):
    run = fake_run(tmp_path / "run")
    lines = [json.loads(x) for x in open(os.path.join(run, "trajectories.jsonl"))]
    assert len(lines) == 3 * 4 and {r["step"] for r in lines} == {1, 2, 3}
    first = [r for r in lines if r["step"] == 1]
    assert [r["sample"] for r in first] == [0, 2, 3, 5]                # lowest to highest reward, spread
    odd = next(r for r in first if r["sample"] == 5)
    assert odd["mask"] == [1, 1, 0, 0, 1, 1] and len(odd["pieces"]) == 6    # padding dropped, observations kept
    assert odd["failures"][0]["reason"].startswith("</script>") and "trainer_logprobs" in odd
    path = os.path.join(run, "trajectories.jsonl")
    size = os.path.getsize(path)
    run_dir.log_trajectories(run, 4, episode_batch(), Tok(), {}, "t", max_bytes=size)   # full: no more
    assert os.path.getsize(path) == size
    for step in (5, 6):   # 3/8 full: every 8th step only
        run_dir.log_trajectories(run, step, episode_batch(), Tok(), {}, "t", max_bytes=size * 8 // 3)
    assert os.path.getsize(path) == size
    run_dir.log_trajectories(run, 8, episode_batch(), Tok(), {}, "t", max_bytes=size * 8 // 3)
    assert os.path.getsize(path) > size


def view(run, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/view.py", run, *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_page_holds_the_records_as_inert_data(tmp_path):
    run = fake_run(tmp_path / "run")
    r = view(run)
    assert r.returncode == 0, r.stderr
    page = open(os.path.join(run, "view.html"), encoding="utf-8").read()
    assert len(re.findall(r"<script", page)) == 2 and "onerror" in page and "<img" not in page   # ours only
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert len(data["records"]) == 12 and data["records"][0]["pieces"][0] in HOSTILE
    bad = view(str(tmp_path / "nowhere"))
    assert bad.returncode != 0 and "holds no trajectories.jsonl" in bad.stderr


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium (Debian: apt-get install -y chromium)")
    return exe


def browse(exe: str, url: str, tmp, *args) -> subprocess.CompletedProcess:
    """Headless Chromium on a file URL, cut off from the network (flags: /work/.library/env/machines/python.md)."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp}", "--window-size=1200,1000"]
    return subprocess.run([exe, *flags, *args, url], capture_output=True, text=True, timeout=120)


def rendered(exe: str, page: str, tmp, query: str = "") -> str:
    r = browse(exe, "file://" + page + query, tmp, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_chromium_renders_rows_and_no_injected_markup(tmp_path):
    exe = chromium()
    run = fake_run(tmp_path / "run")
    assert view(run).returncode == 0
    page = os.path.join(run, "view.html")
    dom = rendered(exe, page, tmp_path / "u1")
    assert dom.count('class="sample"') == 12 and "<title>trajectories: 12 shown</title>" in dom   # the script ran
    assert "pwned" not in re.search(r"<title>.*?</title>", dom).group(0)
    assert "<img" not in dom and "&lt;img src=x onerror" in dom                      # hostile text, as text
    assert dom.count('class="obs"') == 3 * 2                                        # the odd samples' observations
    # filters from the query string: reward >= 3.5 keeps step 3's two best picks (rewards 3 + 3/6, 3 + 5/6)
    dom = rendered(exe, page, tmp_path / "u2", "?rmin=3.5")
    assert dom.count('class="sample"') == 2
    dom = rendered(exe, page, tmp_path / "u3", "?task=echo&colour=gap")
    assert dom.count('class="sample"') == 4 and 'data-step="2"' in dom
    shot = tmp_path / "view.png"
    r = browse(exe, "file://" + page, tmp_path / "u4", f"--screenshot={shot}")
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]


def test_a_packed_training_run_leaves_a_viewable_log(tmp_path, random_model_dir):
    """One train.py run for two checks, in this process (a process start is most of a CPU test's time): pack=true
    trains, and the loop's trajectories.jsonl makes a page that renders."""
    from conftest import step_rows, train_here
    out = tmp_path / "run"
    train_here([f"model={random_model_dir}", "steps=2", "eval_size=8", "prompts_per_step=4", f"out_dir={out}",
                "micro_batch_size=8", "pack=true", "progress=false"])
    assert all(row["logprob_mismatch/max"] < 1e-4 for row in step_rows(out))   # packed trainer = engine log-probs
    recs = [json.loads(x) for x in open(out / "trajectories.jsonl")]
    assert [r["step"] for r in recs] == [1] * 4 + [2] * 4
    assert all(len(r["pieces"]) == len(r["logprobs"]) == len(r["mask"]) > 0 for r in recs)
    assert view(str(out)).returncode == 0
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        dom = rendered(chromium(), str(out / "view.html"), tmp_path / "u")
        assert dom.count('class="sample"') == 8
