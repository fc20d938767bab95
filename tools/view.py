"""What the policy wrote, step by step: one static HTML page from a run directory (no server; opens offline).

    python tools/view.py runs/grpo-20261127-120000            # -> runs/.../view.html; open it in any browser
    python tools/view.py RUN --out /tmp/view.html

It reads RUN/trajectories.jsonl, which train.py writes as it goes (run_dir.log_trajectories: a few samples per
step, spread from the step's lowest reward to its highest), and RUN/metrics.jsonl for each step's mean reward.
Per sample: the prompt, the completion token by token coloured by its sampling log-prob (or, where the loop
computed trainer log-probs, by the engine-vs-trainer gap), each reward by name and the reasons of its failures,
the advantage, and for multi-turn episodes the turns with the environment's observations between them.
Filters: step range, reward range, task, and text; the page's query string sets them at load
(view.html?smin=10&smax=20&rmin=1&task=arithmetic&text=foo&colour=gap).

Completions are the policy's text and rewards' reasons quote it: the page treats all of it as data. The records
travel as JSON inside a script element with every '<', '>' and '&' escaped, and the page's script puts text into
the DOM through textContent only, so nothing a sample contains can become markup or script.
"""
import argparse
import json
import os
import sys

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'">
<title>trajectories</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 0; background: #f6f6f4; color: #222; }
header { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ccc; padding: 8px 14px; z-index: 1; }
header h1 { font-size: 16px; margin: 0 0 6px; }
header label { margin-right: 12px; }
header input[type=number] { width: 70px; }
#count { color: #666; }
main { padding: 10px 14px; }
.sample { background: #fff; border: 1px solid #ddd; border-radius: 6px; margin: 0 0 10px; padding: 8px 10px; }
.head { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: baseline; margin-bottom: 6px; }
.chip { background: #eef; border-radius: 4px; padding: 0 6px; }
.chip.bad { background: #fdd; } .chip.good { background: #dfd; }
.prompt, .completion { white-space: pre-wrap; word-break: break-word; font: 13px ui-monospace, monospace;
  border-left: 3px solid #bbb; padding: 2px 8px; margin: 4px 0; }
.prompt { color: #555; border-color: #99c; }
.tok { border-radius: 2px; }
.obs { display: block; background: #f0f0f0; color: #444; border-left: 3px solid #d90; margin: 3px 0; padding: 1px 6px; }
.obs::before { content: "observation: "; color: #a60; font-style: italic; }
.turn { color: #777; font-style: italic; }
.fail { color: #a00; font: 12px ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; }
.legend { font-size: 12px; color: #555; }
button { margin: 4px 0; }
</style></head>
<body>
<header><h1 id="title"></h1>
<label>step <input id="smin" type="number"> to <input id="smax" type="number"></label>
<label>reward <input id="rmin" type="number" step="any"> to <input id="rmax" type="number" step="any"></label>
<label>task <select id="task"><option value="">all</option></select></label>
<label>text <input id="text" type="search" placeholder="in prompt or completion"></label>
<label>colour <select id="colour"><option value="logp">sampling log-prob</option>
<option value="gap">engine - trainer gap</option></select></label>
<span id="count"></span>
<div class="legend" id="legend"></div></header>
<main id="rows"></main>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const RECS = DATA.records, PAGE_SIZE = 100;
let shown = PAGE_SIZE;
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {            // every piece of sample text enters the page here, as text
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = String(text);
  return e;
}
function fmt(x) { return (typeof x === "number") ? (Math.abs(x) >= 100 ? x.toFixed(0) : x.toFixed(3)) : String(x); }
function colour(rec, i, mode) {          // white = likely / no gap; red = unlikely / large gap
  let v;
  if (mode === "gap") {
    if (!rec.trainer_logprobs) return "";
    v = Math.min(1, Math.abs(rec.logprobs[i] - rec.trainer_logprobs[i]) / 0.5);
  } else {
    v = 1 - Math.exp(rec.logprobs[i]);
  }
  return "rgba(220, 40, 40, " + (0.75 * v).toFixed(3) + ")";
}
function completion(rec, mode) {
  const box = el("div", "completion"), n = rec.pieces.length;
  let i = 0, turn = 0;
  while (i < n) {                        // runs of model tokens (mask 1) and observation tokens (mask 0)
    const m = rec.mask[i];
    let j = i;
    while (j < n && rec.mask[j] === m) j++;
    if (m) {
      turn++;
      if (rec.mask.includes(0)) box.appendChild(el("span", "turn", "[turn " + turn + "] "));
      for (let t = i; t < j; t++) {
        const s = el("span", "tok", rec.pieces[t]);
        s.style.background = colour(rec, t, mode);
        let tip = "log-prob " + rec.logprobs[t].toFixed(4);
        if (rec.trainer_logprobs) tip += "  trainer " + rec.trainer_logprobs[t].toFixed(4);
        if (rec.turn_rewards && rec.turn_rewards[t]) tip += "  turn reward " + rec.turn_rewards[t];
        s.title = tip;
        box.appendChild(s);
      }
    } else {
      box.appendChild(el("span", "obs", rec.pieces.slice(i, j).join("")));
    }
    i = j;
  }
  if (rec.cut_tokens > 0) box.appendChild(el("span", "turn", " [" + rec.cut_tokens + " more tokens not logged]"));
  return box;
}
function card(rec, mode) {
  const c = el("div", "sample"), h = el("div", "head");
  c.dataset.step = rec.step;
  h.appendChild(el("b", "", "step " + rec.step));
  h.appendChild(el("span", "", "sample " + rec.sample + " (group " + rec.group + ")"));
  h.appendChild(el("span", "chip", rec.task));
  const score = DATA.verifier !== null && rec.rewards ? rec.rewards[DATA.verifier] : undefined;
  h.appendChild(el("span", "chip" + (score === undefined ? "" : score >= 1 - 1e-6 ? " good" : " bad"),
                   "reward " + fmt(rec.reward)));
  for (const [name, v] of Object.entries(rec.rewards || {})) h.appendChild(el("span", "chip", name + " " + fmt(v)));
  h.appendChild(el("span", "chip", "advantage " + fmt(rec.advantage)));
  if (rec.truncated) h.appendChild(el("span", "chip bad", "truncated"));
  c.appendChild(h);
  c.appendChild(el("div", "prompt", rec.prompt));
  c.appendChild(completion(rec, mode));
  for (const f of rec.failures || []) c.appendChild(el("div", "fail", f.reward + " / " + f.category + ": " + f.reason));
  return c;
}
function num(id) { const v = $(id).value; return v === "" ? null : Number(v); }
function render() {
  const smin = num("smin"), smax = num("smax"), rmin = num("rmin"), rmax = num("rmax");
  const task = $("task").value, text = $("text").value.toLowerCase(), mode = $("colour").value;
  const keep = RECS.filter((r) => (smin === null || r.step >= smin) && (smax === null || r.step <= smax)
    && (rmin === null || r.reward >= rmin) && (rmax === null || r.reward <= rmax) && (!task || r.task === task)
    && (!text || r.prompt.toLowerCase().includes(text) || r.pieces.join("").toLowerCase().includes(text)));
  const rows = $("rows");
  rows.replaceChildren();
  let lastStep = null;
  for (const rec of keep.slice(0, shown)) {
    if (rec.step !== lastStep) {
      const m = DATA.steps[rec.step] || {};
      const bits = Object.entries(m).map(([k, v]) => k + " " + fmt(v)).join(", ");
      rows.appendChild(el("h3", "", "step " + rec.step + (bits ? " — " + bits : "")));
      lastStep = rec.step;
    }
    rows.appendChild(card(rec, mode));
  }
  if (keep.length > shown) {
    const more = el("button", "", "show " + Math.min(PAGE_SIZE, keep.length - shown) + " more");
    more.onclick = () => { shown += PAGE_SIZE; render(); };
    rows.appendChild(more);
  }
  $("count").textContent = keep.length + " of " + RECS.length + " samples";
  $("legend").textContent = mode === "gap"
    ? (DATA.has_gap ? "completion tokens: red = |engine - trainer log-prob| (full red at 0.5 or more)"
                    : "no trainer log-probs were logged in this run (the loop computes them only with several "
                      + "updates per step or replay): nothing to colour")
    : "completion tokens: red = unlikely under the sampling policy (1 - p)";
  $("legend").textContent += "; hover a token for its log-probs";
  document.title = "trajectories: " + Math.min(keep.length, shown) + " shown";
}
$("title").textContent = DATA.title;
for (const t of [...new Set(RECS.map((r) => r.task))].sort()) $("task").appendChild(el("option", "", t));
const FILTERS = ["smin", "smax", "rmin", "rmax", "task", "text", "colour"];
const query = new URLSearchParams(location.search);   // view.html?smin=10&task=hilo opens filtered
for (const id of FILTERS) {
  if (query.has(id)) $(id).value = query.get(id);
  $(id).addEventListener("input", () => { shown = PAGE_SIZE; render(); });
}
render();
</script></body></html>
"""


def script_json(obj) -> str:
    """JSON safe inside a <script> element: no '<', '>' or '&' (so no '</script>' or '<!--'), no line separators."""
    s = json.dumps(obj, ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        s = s.replace(ch, esc)
    return s


def read_records(path: str) -> list[dict]:
    """trajectories.jsonl -> its records, one per (step, sample): a resumed run writes its steps past the checkpoint
    again, and the later line wins."""
    recs = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:   # a line cut by a crash mid-write
                print(f"{path}:{n}: not JSON, skipped", file=sys.stderr)
                continue
            recs[(r["step"], r["sample"])] = r
    return [recs[k] for k in sorted(recs)]


def step_summaries(run: str) -> dict:
    """step -> the headline numbers of its metrics row (what exists of reward, accuracy, eval/accuracy)."""
    path, out = os.path.join(run, "metrics.jsonl"), {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                out[row["step"]] = {k: row[k] for k in ("reward", "accuracy", "eval/accuracy", "logprob_mismatch/max")
                                    if isinstance(row.get(k), (int, float))}
    return out


def verifier(run: str):
    """The reward whose full marks make a sample correct (accuracy_reward, else the first reward named, as
    rollout.accuracy_name decides), from config.yaml; None if unknown or a multi-turn run's."""
    try:
        import yaml
        with open(os.path.join(run, "config.yaml")) as f:
            cfg = yaml.safe_load(f)
        if (cfg.get("env") or {}).get("name"):   # an environment's episodes report their own success
            return None
        return cfg.get("accuracy_reward") or cfg["rewards"].split(",")[0].rsplit(":", 1)[0].strip()
    except Exception:   # any config without a rewards list of name[:weight]: chips are not coloured
        return None


def build(run: str) -> str:
    recs = read_records(os.path.join(run, "trajectories.jsonl"))
    has_gap = any("trainer_logprobs" in r for r in recs)
    data = {"title": f"{os.path.basename(os.path.abspath(run))}: {len(recs)} samples over "
                     f"{len({r['step'] for r in recs})} steps",
            "has_gap": has_gap, "records": recs, "steps": step_summaries(run), "verifier": verifier(run)}
    return PAGE.replace("__DATA__", script_json(data))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run directory (holds trajectories.jsonl)")
    p.add_argument("--out", default="", help="the HTML file to write (default RUN/view.html)")
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.run, "trajectories.jsonl")):
        p.error(f"'{a.run}' holds no trajectories.jsonl: not a run directory, or a run from before train.py "
                "logged trajectories")
    out = a.out or os.path.join(a.run, "view.html")
    page = build(a.run)
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(out + ".tmp", out)
    print(out)


if __name__ == "__main__":
    main()
