"""update.py's host-free step (issue 38): a fused optimizer that skips itself on the device takes the same steps
as the host's choice, non-finite updates included; micro-batches go up to a GPU without a stream sync."""
import copy

import pytest
import torch

import config
import registry
import update
from buffer import Experience, OnPolicyBuffer
from models import load_model

B, P, C = 8, 4, 6   # rows (2 groups of 4), prompt and completion lengths


def batch(vocab: int, seed: int) -> Experience:
    g = torch.Generator().manual_seed(seed)
    done = torch.arange(C)[None, :] < torch.tensor([6, 6, 5, 4, 6, 3, 6, 2])[:, None]   # completions of several lengths
    mask = torch.cat([torch.ones(B, P, dtype=torch.long), done.long()], 1)               # (B, T)
    return Experience(input_ids=torch.randint(3, vocab, (B, P + C), generator=g), attention_mask=mask,
                      completion_mask=done.float(), sample_logprobs=-torch.rand(B, C, generator=g) * done,
                      rewards=torch.rand(B, generator=g), group_ids=torch.arange(B) // 4,
                      versions=torch.zeros(B, dtype=torch.long), truncated=torch.zeros(B, dtype=torch.bool))


def run_updates(model, fused: bool, device: torch.device, poison: list[bool]) -> tuple[list[dict], torch.optim.AdamW]:
    """update() once per entry of poison (True: a NaN advantage, so the step must be skipped); -> stats, optimizer."""
    cfg = config.Config()
    cfg.micro_batch_size, cfg.samples_per_prompt, cfg.lr = 3, 4, 1e-3   # several micro-batches, 2 groups
    config.fill_defaults(cfg)
    algo = registry.get("algo", "grpo")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    learner = update.Learner(model, optimizer, schedule, algo, cfg, device)
    stats = []
    for i, bad in enumerate(poison):
        buffer = OnPolicyBuffer()
        b = batch(model.config.vocab_size, seed=i)
        b.advantages = algo.advantages(b, cfg.algo)
        if bad:
            b.advantages[0] = float("nan")
        buffer.add(b)
        stats.append(update.update(learner, buffer, torch.Generator().manual_seed(i), step=i + 1, n_samples=B))
    return stats, optimizer


def flat(stats: dict) -> dict:
    """update()'s stats as plain numbers: a reduction-tagged value (distributed.Ratio, Max ...) gives its fields."""
    out = {}
    for k, v in stats.items():
        out.update({f"{k}.{f}": x for f, x in vars(v).items()} if hasattr(v, "__dataclass_fields__") else {k: v})
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_device_side_skip_takes_the_host_choice_steps(random_model_dir, device):
    """fused AdamW (found_inf on the device) against the foreach one (the host decides): the same updates applied
    and skipped, the same parameters after, the same step counts."""
    base, _ = load_model(random_model_dir, torch.device(device), torch.float32)
    poison = [False, True, False]                       # a good step, a skipped one, a good one
    out = {}
    for fused in (True, False):
        model = copy.deepcopy(base)
        assert update.on_device_skip(torch.optim.AdamW(model.parameters(), fused=fused)) is fused
        stats, opt = run_updates(model, fused, torch.device(device), poison)
        out[fused] = (stats, opt, torch.cat([p.detach().flatten() for p in model.parameters()]))
    (s1, o1, p1), (s0, o0, p0) = out[True], out[False]
    assert [s["skipped_updates"] for s in s1] == [s["skipped_updates"] for s in s0] == [0, 1, 0]
    for a, b in zip(s1, s0):   # the same computation up to the step (fused and foreach AdamW may differ in ulps)
        a, b = flat(a), flat(b)
        assert a.keys() == b.keys() and a == pytest.approx(b, rel=1e-4, abs=1e-6, nan_ok=True), (a, b)
    start = torch.cat([p.detach().flatten() for p in base.parameters()])
    assert (p0 - start).abs().max() > 1e-4                                   # the updates moved the weights
    assert torch.allclose(p1, p0, rtol=1e-5, atol=1e-6), (p1 - p0).abs().max()
    steps = {float(st["step"]) for o in (o1, o0) for st in o.state.values()}
    assert steps == {2.0}                                                    # the skipped step counted nowhere


def test_a_skipped_device_step_changes_nothing(random_model_dir):
    """Only skipped steps: the fused path leaves weights and moments exactly as they were."""
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    start = [p.detach().clone() for p in model.parameters()]
    stats, opt = run_updates(model, True, torch.device("cpu"), [True, True])
    assert [s["skipped_updates"] for s in stats] == [1, 1]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start))
    assert all(float(st["step"]) == 0 and not st["exp_avg"].any() for st in opt.state.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_micro_batches_reach_the_gpu_without_a_sync():
    b = batch(50, seed=0)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):   # the plain copy from pageable memory syncs
            b.to(device)
        on = update.to_device(b, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(getattr(on, k).cpu(), getattr(b, k)) for k in ("input_ids", "completion_mask", "rewards"))
    assert on.input_ids.device == device and on.old_logprobs is None


def test_to_device_on_the_cpu_keeps_the_tensors():
    b = batch(50, seed=0)
    on = update.to_device(b, torch.device("cpu"))
    assert on.input_ids is b.input_ids and on.advantages is None
