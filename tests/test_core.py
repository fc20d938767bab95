"""Tier-1 unit tests: hand-derived values for the registry, config, advantages, losses and the engine."""
import math
import os
import subprocess
import sys

import pytest
import torch

import algos, tasks  # noqa: F401,E401  (the plugin packages: their own option sections are part of the tree)
import config
import registry
from algos.common import aggregate, kl_estimate
from algos.grpo import clipped_policy_loss, group_advantages, grpo_advantages
from buffer import Experience, OnPolicyBuffer
from config import UserError


# --- registry -------------------------------------------------------------------------------------
def test_registry_unknown_name_lists_known():
    with pytest.raises(registry.RegistryError, match=r"unknown algo 'nope'; known: .*grpo"):
        registry.get("algo", "nope")


def test_registry_duplicate_raises():
    registry.register("task", "__dup_test")(lambda cfg: ([], []))
    try:
        with pytest.raises(registry.RegistryError, match="registered twice"):
            registry.register("task", "__dup_test")(lambda cfg: ([], []))
    finally:   # the registry is process-global: the other tests see only the project's plugins
        registry._REGISTRY["task"].pop("__dup_test")


def test_registry_unknown_kind():
    with pytest.raises(registry.RegistryError, match="unknown plugin kind"):
        registry.register("nonsense", "x")


# --- config ---------------------------------------------------------------------------------------
def test_config_overrides_and_types():
    cfg = config.parse(["steps=7", "algo.kl_coef=0.5", "algo.scale_rewards=false", "model=foo/bar"])
    assert (cfg.steps, cfg.algo.kl_coef, cfg.algo.scale_rewards, cfg.model) == (7, 0.5, False, "foo/bar")


def test_config_unknown_key_names_it():
    with pytest.raises(UserError, match="unknown config key 'algo.nope'"):
        config.parse(["algo.nope=1"])
    with pytest.raises(UserError, match="unknown config key 'stepz'"):
        config.parse(["stepz=1"])


def test_config_wrong_type_names_key():
    with pytest.raises(UserError, match="config key 'steps' expects int, got 'ten'"):
        config.parse(["steps=ten"])
    with pytest.raises(UserError, match="config key 'algo.kl_coef' expects float"):
        config.parse(["algo.kl_coef=true"])


def test_config_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 3\nalgo:\n  clip_eps: 0.1\n")
    cfg = config.parse(["--config", str(p), "steps=4"])          # command line wins over the file
    assert cfg.steps == 4 and cfg.algo.clip_eps == 0.1


def test_help_lists_every_option():
    text = config.help_text()
    for key in ["steps=", "algo.kl_coef=", "arithmetic.digits=", "samples_per_prompt="]:
        assert key in text


SECTION_PLUGIN = """
import dataclasses, sys
import algos, config, config_checks
from config import opt, section

@section("algo.my_variant", "my variant's options")
@dataclasses.dataclass
class MyConfig:
    mode: str = opt("a", "which form", choices=("a", "b"))
    coef: float = opt(0.5, "a coefficient")

    def check(self, cfg):
        return [("coef", self.coef >= 0, ">= 0")]

cfg = config.parse(["--config", sys.argv[1], "algo.my_variant.coef=0.25"])
assert (cfg.algo.my_variant.mode, cfg.algo.my_variant.coef, config.AlgoConfig().my_variant.coef) == ("b", 0.25, 0.5)
assert "algo.my_variant.mode='a'" in config.help_text() and config.to_dict(cfg)["algo"]["my_variant"]["mode"] == "b"
for argv in (["algo.my_variant.mode=c"], ["algo.my_variant.coef=-1"]):
    try:
        config_checks.validate(config.fill_defaults(config.parse(argv)))
    except config.UserError as e:
        print(e)
try:
    section("algo.my_variant", "again")(MyConfig)
except KeyError as e:
    print(e)
"""


def test_a_plugin_declares_its_own_section(tmp_path):
    """A section declared in a plugin's own file joins the one tree (YAML, key=value, --help, to_dict); its choices
    and its check apply before any work; a path declared twice is refused. In a fresh process: declaring one
    changes the core dataclasses for the rest of the process."""
    (tmp_path / "c.yaml").write_text("algo:\n  my_variant:\n    mode: b\n")
    out = subprocess.run([sys.executable, "-c", SECTION_PLUGIN, str(tmp_path / "c.yaml")], capture_output=True,
                         text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["config key 'algo.my_variant.mode' must be one of a, b; got 'c'",
                                       "config key 'algo.my_variant.coef' must be >= 0; got -1.0",
                                       "section 'algo.my_variant' is registered twice"]


def test_help_lists_the_names_registered_for_a_choice():
    """algo.name's help is read from the registry: a new algorithm shows up in --help with no edit to config.py."""
    import algos  # noqa: F401  (registers every algorithm)
    registry.register("algo", "my_variant")(object())
    try:
        line = next(l for l in config.help_text().splitlines() if l.lstrip().startswith("algo.name="))
    finally:
        registry._REGISTRY["algo"].pop("my_variant")
    assert all(name in line for name in ["grpo", "ppo", "my_variant"])


def test_the_hand_kept_lists_name_every_registered_plugin():
    """The lists a reader meets (the plugin packages' file tables, docs/environments.md) name what the registry
    holds: a new plugin fails here until it is listed, a removed one until its line goes."""
    import ast
    import envs, rewards, tasks  # noqa: F401,E401  (register every reward, task, environment and tool)
    from envs.tools import PARSERS
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tables = " ".join(ast.get_docstring(ast.parse(open(os.path.join(root, pkg, "__init__.py")).read()))
                      for pkg in ("rewards", "tasks", "envs"))
    def ours(kind):   # the project's plugins, not those a test registered for itself
        return [n for n in registry.names(kind)
                if getattr(registry.get(kind, n), "__module__", "").split(".")[0] in ("rewards", "tasks", "envs")]
    assert len(ours("reward")) >= 6 and ours("env") and ours("tool")
    for kind in ("reward", "task", "env", "tool"):
        missing = [n for n in ours(kind) if f"{kind} {n}" not in tables]
        assert not missing, f"{kind} {missing} registered but not in the __init__.py tables of rewards/ tasks/ envs/"
    doc = open(os.path.join(root, "docs", "environments.md")).read()
    missing = [n for n in [*ours("env"), *ours("tool"), *PARSERS] if f"`{n}`" not in doc]
    assert not missing, f"docs/environments.md does not name {missing}"


# --- advantages and losses -----------------------------------------------------------------------
def test_group_advantages_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.25, unbiased std sqrt(0.25) = 0.5 -> (0.75/0.5, -0.25/0.5 x3); group 1: all equal -> 0
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0])
    assert torch.allclose(group_advantages(r, g), expected, atol=1e-5)
    assert torch.allclose(group_advantages(r, g, scale=False), torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0]))


def _toy_batch(B=4, C=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float)[:B, :C]
    return Experience(input_ids=torch.zeros(B, 2 + C, dtype=torch.long), attention_mask=torch.ones(B, 2 + C),
                      completion_mask=mask, sample_logprobs=torch.zeros(B, C),
                      rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]),
                      versions=torch.zeros(B, dtype=torch.long), truncated=torch.zeros(B, dtype=torch.bool)), gen


def test_grpo_on_policy_gradient_equals_reinforce():
    batch, gen = _toy_batch()
    cfg = config.AlgoConfig()
    batch.advantages = grpo_advantages(batch, cfg)
    logits = torch.randn(4, 3, requires_grad=True, generator=gen)
    logp = torch.nn.functional.logsigmoid(logits)            # any differentiable per-token log-prob
    loss, _ = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(4, 3)}, batch, cfg)
    (g_grpo,) = torch.autograd.grad(loss, logits)
    # REINFORCE with the group-mean baseline, token-mean aggregation: -sum(A * logp * mask) / sum(mask)
    logp2 = torch.nn.functional.logsigmoid(logits)
    reinforce = -(batch.advantages * logp2 * batch.completion_mask).sum() / batch.completion_mask.sum()
    (g_ref,) = torch.autograd.grad(reinforce, logits)
    assert torch.allclose(g_grpo, g_ref, atol=1e-6)
    assert abs(loss.item()) < 1e-6 or True  # value is -mean(A) over tokens; the gradient is what matters


def test_grpo_clipping_stops_gradient():
    batch, _ = _toy_batch()
    cfg = config.AlgoConfig(clip_eps=0.2, clip_eps_high=0.2)
    batch.advantages = torch.ones(4, 3) * batch.completion_mask        # positive advantage everywhere
    batch.old_logprobs = torch.zeros(4, 3)
    logp = torch.full((4, 3), math.log(1.5), requires_grad=True)       # ratio 1.5 > 1.2: clipped
    loss, m = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(4, 3)}, batch, cfg)
    loss.backward()
    assert torch.all(logp.grad == 0) and m["clip_frac"] == 1.0
    assert loss.item() == pytest.approx(-1.2)


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])   # log r = log 2
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    assert kl_estimate(ref, ref, "k3").item() == 0.0


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx((6 / 5 + 4 / 5) / 2)


# --- buffer ---------------------------------------------------------------------------------------
def test_minibatches_keep_groups_together():
    batch, gen = _toy_batch()
    batch.group_ids = torch.tensor([0, 0, 1, 1])
    buf = OnPolicyBuffer()
    buf.add(batch)
    seen = []
    for mb in buf.minibatches(2, epochs=2, generator=gen, group_size=2):
        assert len(mb) == 2 and mb.group_ids[0] == mb.group_ids[1]
        seen.append(int(mb.group_ids[0]))
    assert sorted(seen) == [0, 0, 1, 1]


def test_experience_cat_repads_prompt_left_and_completion_right():
    a, _ = _toy_batch()
    b = a.select(torch.tensor([0, 1]))
    b.input_ids = torch.ones(2, 4, dtype=torch.long)                   # prompt 2, completion 2
    b.attention_mask = torch.ones(2, 4)
    b.completion_mask, b.sample_logprobs = torch.ones(2, 2), torch.ones(2, 2)
    b.input_ids[:, :1] = 7
    out = Experience.cat([a.select(torch.tensor([0, 1])), b], pad_id=9)
    assert out.input_ids.shape == (4, 5) and out.completion_mask.shape == (4, 3)
    assert out.input_ids[2].tolist() == [7, 1, 1, 1, 9]                 # completion padded on the right
    assert out.completion_mask[2].tolist() == [1, 1, 0]


def test_experience_cat_pads_per_token_fields_of_any_rank_along_time():
    a, b = _toy_batch(C=3)[0].select(torch.tensor([0, 1])), _toy_batch(C=2)[0].select(torch.tensor([0, 1]))
    a.ref_hidden, b.ref_hidden = torch.randn(2, 3, 5), torch.randn(2, 2, 5)          # (B, C, H), widths differ
    a.values, b.values = torch.randn(2, 3), torch.randn(2, 2)
    out = Experience.cat([a, b])
    assert out.ref_hidden.shape == (4, 3, 5) and out.values.shape == (4, 3)
    assert torch.equal(out.ref_hidden[:2], a.ref_hidden) and torch.equal(out.ref_hidden[2:, :2], b.ref_hidden)
    assert not out.ref_hidden[2:, 2:].any() and not out.values[2:, 2:].any()          # the pad column is zeros


def test_context_length_reads_a_vlm_text_config():
    from types import SimpleNamespace
    from transformers import LlavaConfig, Qwen2Config, Qwen2VLConfig
    from models import context_length
    length = lambda c: context_length(SimpleNamespace(config=c))
    assert length(Qwen2Config(max_position_embeddings=77)) == 77
    assert length(Qwen2VLConfig(text_config={"max_position_embeddings": 99})) == 99      # in text_config only
    assert length(LlavaConfig(text_config={"model_type": "qwen2", "max_position_embeddings": 55})) == 55
    assert length(SimpleNamespace()) == 1 << 30                                         # a config naming none


# --- engine ---------------------------------------------------------------------------------------
def test_sampling_logprobs_match_teacher_forcing(random_model_dir):
    from models import completion_logprobs, load_model
    from engines.builtin import BuiltinEngine
    from engines.base import SamplingParams
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "123+456=", "7="]]          # different lengths: left padding
    gen = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.7):
        r = engine.generate(prompts, 4, SamplingParams(temperature=temperature, max_new_tokens=12), gen)
        C = r.completion_mask.shape[1]
        with torch.no_grad():
            logp, _ = completion_logprobs(model, r.input_ids, r.attention_mask, C, temperature)
        diff = ((logp - r.logprobs).abs() * r.completion_mask).max().item()
        assert diff <= 1e-4, diff
        assert r.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_completion_mask_stops_after_eos(random_model_dir):
    from models import load_model
    from engines.builtin import BuiltinEngine
    from engines.base import SamplingParams
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id)
    r = engine.generate([tok("12+3=")["input_ids"]], 64, SamplingParams(max_new_tokens=10),
                        torch.Generator().manual_seed(1))
    comp = r.input_ids[:, -r.completion_mask.shape[1]:]
    for row, m, trunc in zip(comp, r.completion_mask, r.truncated):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()                          # mask is a prefix
        eos_at = (row == tok.eos_token_id).nonzero()
        if trunc:
            assert n == r.completion_mask.shape[1] and len(eos_at) == 0
        else:
            assert row[n - 1] == tok.eos_token_id                      # EOS is the last masked token
    assert r.truncated.any() and (~r.truncated).any()                   # both cases were exercised


def test_top_p_keeps_smallest_nucleus():
    from engines.base import top_p_filter
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 1.0)).all()


def test_chat_template_is_applied_when_present(random_model_dir):
    from transformers import AutoTokenizer
    from models import encode_prompts
    tok = AutoTokenizer.from_pretrained(random_model_dir)
    plain = encode_prompts(tok, ["12+3"])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    assert encode_prompts(tok, ["12+3"]) == [plain[0] + tok("=")["input_ids"]]
