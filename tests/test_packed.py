"""pack=true (microbatch.pack, update.packed_completion): one sequence of real tokens per micro-batch, positions
restarting per sample, gives the padded path's losses and gradients, for every loss_agg, multi-turn observations
included, through the log-prob and the fused-loss kernels and a head that is not plain. (A whole `train.py
pack=true` run: tests/test_view.py, test_a_packed_training_run_leaves_a_viewable_log.)"""
import pytest
import torch

import config
import registry
import update
from algos.common import AGG_MODES
from buffer import Experience
from microbatch import pack, packed_micro_batches
from models import load_model

# (prompt length, completion) per sample: m = model token, o = observation (attended, out of the loss), . = padding
LAYOUTS = [(2, "mmmoommm...."), (5, "mmmmmmmmmmmm"), (3, "m..........."),
           (4, "mmoommoomm.."), (1, "mmmmm......."), (5, "mmooommmmmmm")]


def multiturn_batch(vocab: int, seed: int = 0) -> Experience:
    """Six samples in two groups on the padded layout (buffer.py): left-padded prompts of 1-5 tokens, completions of
    model turns with observations between them, right padding."""
    g = torch.Generator().manual_seed(seed)
    P, C = max(p for p, _ in LAYOUTS), len(LAYOUTS[0][1])
    B = len(LAYOUTS)
    attn, cmask = torch.zeros(B, P + C, dtype=torch.long), torch.zeros(B, C)
    for i, (p, comp) in enumerate(LAYOUTS):
        attn[i, P - p:P] = 1
        attn[i, P:] = torch.tensor([c != "." for c in comp])
        cmask[i] = torch.tensor([float(c == "m") for c in comp])
    ids = torch.randint(2, vocab, (B, P + C), generator=g) * attn                    # padding id 0
    sample = -torch.rand(B, C, generator=g) * cmask
    return Experience(input_ids=ids, attention_mask=attn, completion_mask=cmask, sample_logprobs=sample,
                      rewards=torch.rand(B, generator=g), group_ids=torch.arange(B) // 3,
                      versions=torch.zeros(B, dtype=torch.long), truncated=torch.zeros(B, dtype=torch.bool),
                      old_logprobs=sample + 0.1 * torch.randn(B, C, generator=g) * cmask,
                      ref_logprobs=sample - 0.05 * cmask)


@pytest.fixture(scope="module")
def model(random_model_dir):
    return load_model(random_model_dir, torch.device("cpu"), torch.float32)[0]


def biased_head(model):
    """A copy of model whose lm_head has a bias: not a plain head, so the packed path takes logits."""
    import copy
    m = copy.deepcopy(model)
    head = m.get_output_embeddings()
    new = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        new.weight.copy_(head.weight)
        new.bias.copy_(torch.randn(head.out_features, generator=torch.Generator().manual_seed(1)))
    m.lm_head = new
    m.config.tie_word_embeddings = False
    return m


def update_pass(model, algo_name: str, loss_agg: str, norm_len: int, batch: Experience, **opts):
    """update.accumulate_gradients on batch -> (loss, mismatch sum, flat gradient)."""
    cfg = config.Config()
    cfg.algo.name, cfg.algo.loss_agg, cfg.algo.norm_len, cfg.algo.kl_coef = algo_name, loss_agg, norm_len, 0.1
    for k, v in opts.items():
        setattr(cfg, k, v)
    algo = registry.get("algo", algo_name)
    batch.advantages = algo.advantages(batch, cfg.algo)
    learner = update.Learner(model, None, None, algo, cfg, torch.device("cpu"))
    model.zero_grad()
    m = update.accumulate_gradients(learner, batch, measure_mismatch=True)
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return float(m["loss"]), float(m["_mis_sum"]), grad


@pytest.mark.parametrize("loss_agg, norm_len", [(a, 0) for a in AGG_MODES] + [("seq-mean-token-sum-norm", 16)])
@pytest.mark.parametrize("fused_loss", [False, True])
def test_packed_update_equals_padded(model, loss_agg, norm_len, fused_loss):
    batch = multiturn_batch(model.config.vocab_size)
    loss0, mis0, grad0 = update_pass(model, "grpo", loss_agg, norm_len, batch, fused_loss=fused_loss)
    assert grad0.abs().sum() > 0 and loss0 != 0
    for micro in (0, 2):   # the whole batch in one packed sequence; three balanced packed pieces
        loss, mis, grad = update_pass(model, "grpo", loss_agg, norm_len, batch, fused_loss=fused_loss, pack=True,
                                      micro_batch_size=micro)
        assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-6), micro
        assert mis == pytest.approx(mis0, rel=1e-5, abs=1e-5), micro   # the trainer's log-probs, token by token
        assert torch.allclose(grad, grad0, rtol=1e-5, atol=1e-5), (micro, (grad - grad0).abs().max())


@pytest.mark.parametrize("algo_name, micro", [("gspo", 0), ("grpo", 2)])   # gspo does not split (its Algorithm)
def test_packed_update_equals_padded_without_a_plain_head(model, algo_name, micro):
    """A biased head: logits of the kept tokens (logits_to_keep = their predecessors), not the hidden-state kernel;
    gspo's sequence-level ratio needs each row's log-probs back in their row."""
    m, batch = biased_head(model), multiturn_batch(model.config.vocab_size, seed=3)
    loss0, mis0, grad0 = update_pass(m, algo_name, "seq-mean-token-mean", 0, batch)
    loss, mis, grad = update_pass(m, algo_name, "seq-mean-token-mean", 0, batch, pack=True, micro_batch_size=micro)
    assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-6) and mis == pytest.approx(mis0, rel=1e-5, abs=1e-5)
    assert torch.allclose(grad, grad0, rtol=1e-5, atol=1e-5), (grad - grad0).abs().max()


@pytest.mark.parametrize("attention", ["eager", update.VARLEN])
def test_packed_attention_holds_through_a_checkpointed_backward(model, monkeypatch, attention):
    """The packed forward switches attention (update.VARLEN, flash-attn or flex); gradient checkpointing recomputes
    in backward, which must see the same attention and the same sample bounds. On a copy with checkpointing."""
    import copy
    m = copy.deepcopy(model)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    batch = multiturn_batch(model.config.vocab_size, seed=4)
    loss0, _, grad0 = update_pass(m, "grpo", "token-mean", 0, batch)
    seen, calls, varlen = [], [], update.varlen_attention
    monkeypatch.setattr(update, "packed_attention_name", lambda model: seen.append(1) or attention)
    monkeypatch.setattr(update, "varlen_attention", lambda *a, **k: calls.append(a[4]) or varlen(*a, **k))
    loss, _, grad = update_pass(m, "grpo", "token-mean", 0, batch, pack=True, micro_batch_size=2)
    assert seen and m.config._attn_implementation == "sdpa"       # switched for the update, then back
    layers = m.config.num_hidden_layers   # 3 pieces x layers x (forward + recompute); no mask ever built for it
    assert calls == ([None] * (3 * layers * 2) if attention == update.VARLEN else []), len(calls)
    assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, grad0, rtol=1e-5, atol=1e-5), (grad - grad0).abs().max()


def reference_attention(q, k, v, bounds, scale=None):
    """Causal attention within each sample, one sdpa per sample: q (N, Hq, D), k / v (N, Hkv, D) -> (N, Hq, D)."""
    rep = q.shape[1] // k.shape[1]
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1), k[a:b].repeat_interleave(rep, 1).transpose(0, 1),
        v[a:b].repeat_interleave(rep, 1).transpose(0, 1), is_causal=True, scale=scale).transpose(0, 1)
        for a, b in zip(bounds, bounds[1:])])


def old_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None):
    """A stand-in with the keywords of torch's first varlen_attn (equal head counts only)."""
    assert is_causal and max_q == max_k == 7 and k.shape[1] == q.shape[1]
    return reference_attention(q, k, v, cu_q.tolist())


def new_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
               enable_gqa=False):
    """A stand-in with the keywords of a later varlen_attn (windows, scale, grouped-query heads)."""
    assert window_size == (-1, 0) and max_q == max_k == 7 and (enable_gqa or k.shape[1] == q.shape[1])
    return reference_attention(q, k, v, cu_q.tolist(), scale)


@pytest.mark.parametrize("fake", [old_varlen, new_varlen])
def test_flash_varlen_speaks_each_torch_versions_keywords(monkeypatch, fake):
    """torch's varlen_attn changed keywords between versions (is_causal -> window_size; scale and enable_gqa came
    later): flash_varlen must ask each for causal grouped-query attention."""
    monkeypatch.setattr(update, "TORCH_VARLEN", update.varlen_api(fake))
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(12, 4, 8, generator=g), torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = update.flash_varlen(q, k, v, cu, 7, 8 ** -0.5)
    assert torch.allclose(out, reference_attention(q, k, v, [0, 5, 12]), atol=1e-6)
    if fake is old_varlen:
        with pytest.raises(ValueError, match="no scale argument"):
            update.flash_varlen(q, k, v, cu, 7, 0.5)


@pytest.mark.skipif(not torch.cuda.is_available() or update.TORCH_VARLEN is None,
                    reason="torch's varlen flash kernel needs CUDA")
def test_varlen_attention_on_the_gpu_matches_per_sample_attention():
    """update.VARLEN's GPU path (torch's flash varlen kernel, bf16, grouped-query) against sdpa sample by sample,
    forward and backward."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bounds = [0, 70, 71, 300, 812]
    q = torch.randn(1, 14, 812, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 812, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    module = torch.nn.Module()
    out, _ = update.varlen_attention(module, q, k, v, None, scaling=0.125,
                                     cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32, device="cuda"),
                                     max_length_q=512)
    (out.float() ** 2).sum().backward()
    got = [out[0]] + [t.grad for t in (q, k, v)]
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]   # the reference in float32
    ref = reference_attention(*(t[0].transpose(0, 1) for t in exact), bounds, 0.125)
    (ref ** 2).sum().backward()
    for a, b in zip(got, [ref] + [t.grad for t in exact]):
        assert (a.float() - b).norm() / b.norm() < 1e-2, ((a.float() - b).norm() / b.norm())


def test_pack_layout():
    batch = multiturn_batch(14)
    p = pack(batch)
    real = batch.attention_mask.bool()
    lengths = batch.attention_mask.sum(-1)
    assert p.cu_seqlens.tolist() == [0] + lengths.cumsum(0).tolist() and p.max_len == int(lengths.max())
    assert p.input_ids.shape == (1, int(real.sum())) and (p.input_ids[0] == batch.input_ids[real]).all()
    starts = (p.position_ids[0] == 0).nonzero().flatten()                           # one restart per sample
    assert starts.tolist() == [0] + batch.attention_mask.sum(-1).cumsum(0)[:-1].tolist()
    C = batch.completion_mask.shape[1]
    assert (p.input_ids[0, p.src + 1] == batch.input_ids[:, -C:][p.keep]).all()   # each kept token follows its src
    assert p.keep.sum() == batch.completion_mask.sum()
    bad = multiturn_batch(14)
    bad.attention_mask[0, -C + 4] = 0    # a hole (an observation column) before a model token: nothing predicts it
    with pytest.raises(ValueError, match="follows a padding column"):
        pack(bad)


def test_packed_pieces_are_balanced_and_cover_every_row():
    batch = multiturn_batch(14)
    pieces = list(packed_micro_batches(batch, 2, "token-mean"))
    assert len(pieces) == 3
    assert sum(p.attention_mask.sum() for p, _ in pieces) == batch.attention_mask.sum()
    assert sum(w for _, w in pieces) == pytest.approx(1.0)
    loads = [int(p.attention_mask.sum()) for p, _ in pieces]
    assert max(loads) - min(loads) <= int(batch.attention_mask.sum(-1).max())   # greedy bound: one row at most
    with pytest.raises(ValueError, match="loss_agg"):
        list(packed_micro_batches(batch, 2, "nonsense"))


def test_w7_bench_tiny(tmp_path):
    """tools/bench_w7.py --tiny: both variants run on the same forced lengths and the report counts their tokens."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "tools/bench_w7.py", "--tiny", "--micro", "4", "--repeats", "1", "--threads",
                        "1", "--packed-attn", "auto", "--out", str(tmp_path)], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "w7.json").read_text())
    t, v = res["tokens"], res["variants"]
    assert t["packed"] == t["real"] < t["bucketed"]            # padding: only the bucketed forwards run it
    assert set(v) == {"bucketed", "packed, auto"} and all(r["median_s"] > 0 for r in v.values())
    assert v["packed, auto"]["loss"] == pytest.approx(v["bucketed"]["loss"], rel=1e-4, abs=1e-6)
    assert "| packed, auto |" in (tmp_path / "w7.md").read_text()
