"""LoRA through peft (lora.py) and the per-stage memory options (offload.py).

Unit tests on conftest's random 2-layer model (a second each); three short train.py runs (exact resume, offload
on/off). On a GPU machine the offload test moves real memory; on CPU it runs the same code with nothing to move.
"""
import copy
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lora
from config import LoRAConfig, UserError

TIMING = ("time/", "mem/", "tokens_per_s")
# float noise (CPU-model dependent): never compared exactly; the runs' rewards and losses check the weights
NOISE = (*TIMING, "logprob_mismatch/")


def lora_model(model_dir, r=4, targets="all-linear", seed=1):
    """The random model with LoRA adapters whose B is random too (peft starts B at 0: the adapters would be a
    no-op and every comparison below trivially equal)."""
    from models import load_model
    base, tok = load_model(model_dir, torch.device("cpu"), torch.float32)
    model = lora.wrap(base, LoRAConfig(r=r, alpha=2 * r, targets=targets), model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model, tok


def batch(tok):
    from engines.base import left_pad
    ids, mask = left_pad([tok(p)["input_ids"] for p in ["1+2=34", "123+456=579", "7=7"]], tok.pad_token_id)
    return ids, mask


def test_reference_with_adapters_off_is_the_frozen_base_exactly(random_model_dir):
    from models import completion_logprobs, load_model
    model, tok = lora_model(random_model_dir)
    base, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    base.eval()
    ids, mask = batch(tok)
    with torch.no_grad():
        ref = completion_logprobs(lora.AdaptersOff(model), ids, mask, 4)[0]            # (B, C)
        frozen = completion_logprobs(base, ids, mask, 4)[0]
        adapted = completion_logprobs(model, ids, mask, 4)[0]
    assert torch.equal(ref, frozen)                        # bit for bit: no second copy, no merge round trip
    assert (adapted - frozen).abs().max() > 1e-3           # while the adapters do change the policy
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())   # only adapters train


def test_merged_weights_equal_peft_merge_and_load_in_transformers(random_model_dir, tmp_path):
    """engine_weights (what vLLM gets) and final/merged are peft's own merge, under the transformers names."""
    from transformers import AutoModelForCausalLM
    model, tok = lora_model(random_model_dir)
    merged = copy.deepcopy(model).merge_and_unload()
    expect = dict(merged.named_parameters())
    got = dict(lora.engine_weights(model))
    assert got.keys() == expect.keys()
    assert all(torch.allclose(got[k], expect[k], atol=1e-6) for k in got)
    lora.save_merged(model, tok, str(tmp_path / "merged"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids, mask = batch(tok)
    with torch.no_grad():
        a, b = loaded(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a, b, atol=1e-5)


class Watch(TorchDispatchMode):
    """Counts GEMMs (2-D matmuls: attention's are batched) and copies of the group weights: an op other than a GEMM
    that reads a tensor on one of `storages` and allocates an output at least as large (a cat, clone, cast or sum)."""
    GEMMS = ("mm", "addmm", "addmm_", "low_rank_add")   # the last: one addmm_ (engines/decode_weights.py)

    def __init__(self, storages: set):
        super().__init__()
        self.storages, self.gemms, self.copies = storages, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.gemms += name in self.GEMMS
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        ptrs = {t.untyped_storage().data_ptr() for t in ins}
        for t in (t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and name not in self.GEMMS):
            fresh = t.untyped_storage().data_ptr() not in ptrs
            if fresh and any(i.untyped_storage().data_ptr() in self.storages and t.numel() >= i.numel() for i in ins):
                self.copies.append(name)
        return out


def projections(model) -> list:
    """Per layer, its seven projections in group order (q, k, v, gate, up, o, down)."""
    from engines.decode_weights import groups
    return [[m for g in groups(layer) for m in g] for layer in model.get_base_model().model.layers]


@pytest.mark.parametrize("weights,targets,pack", [("fused", "all-linear", True), ("in_place", "all-linear", True),
                                                  ("in_place", "q_proj,v_proj,down_proj", True),
                                                  ("in_place", "all-linear", False)])
def test_fast_decoder_samples_with_the_adapted_policy(random_model_dir, weights, targets, pack, monkeypatch):
    """fused: the adapters merged into the fast path's own weights; in_place: no copy of any base weight, the
    low-rank products beside each projection (targets on some projections of a group test the block layout),
    each group's weights and adapters' A re-packed into one buffer (pack=False: the unpacked route). Either way
    its sampling log-probs are the peft model's, also after the adapters change between rollouts."""
    from engines import decode_weights
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from engines.decode_weights import base_weight, bias_of
    from engines.fast_decode import FastDecoder, supported
    from models import completion_logprobs
    monkeypatch.setattr(decode_weights, "PACK", pack)
    model, tok = lora_model(random_model_dir, targets=targets)
    assert supported(model)
    params = [[(base_weight(m), base_weight(m).detach().clone()) for m in ms] for ms in projections(model)]
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id, fast=True)
    engine.decoder = dec = FastDecoder(model, attention="sdpa", use_graph=False, weights=weights)   # packs here
    storages = {base_weight(m).untyped_storage().data_ptr() for ms in projections(model) for m in ms}
    watch, per_step = Watch(storages), []
    step = dec._step
    dec._step = lambda *a: (per_step.append(-watch.gemms), step(*a), per_step.append(per_step.pop() + watch.gemms))[1]
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "123+456="]]
    for seed in (0, 1):
        if seed:   # a training step moved the adapters: the next rollout samples with the new ones
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_A" in name or "lora_B" in name:
                        p.add_(torch.randn_like(p) * 0.05)
        with watch:   # the second rollout: what a rollout launches and allocates once the decoder exists
            r = engine.generate(prompts, 3, SamplingParams(max_new_tokens=10), torch.Generator().manual_seed(seed))
        C = r.completion_mask.shape[1]
        with torch.no_grad():
            logp = completion_logprobs(model, r.input_ids, r.attention_mask, C)[0]
            base = completion_logprobs(lora.AdaptersOff(model), r.input_ids, r.attention_mask, C)[0]
        assert ((logp - r.logprobs).abs() * r.completion_mask).max() <= 1e-4
        assert ((base - r.logprobs).abs() * r.completion_mask).max() > 1e-3       # not the base's
    # the same Parameters, same values, frozen; packed: views of one buffer per group
    now = [[base_weight(m) for m in ms] for ms in projections(model)]
    assert all(p is w and torch.equal(w, v) and not w.requires_grad for ps, ws in zip(params, now)
               for (p, v), w in zip(ps, ws))
    layer = now[0]
    shared = lambda ws: len({w.untyped_storage().data_ptr() for w in ws}) == 1
    packed = weights == "in_place" and pack
    assert shared(layer[:3]) == shared(layer[3:5]) == packed and not shared([layer[0], layer[3], layer[5]])
    biases = [bias_of(m) for m in projections(model)[0][:3]]                 # Qwen's q/k/v: a buffer of their own
    assert shared(biases) == packed and not shared([biases[0], layer[0]])
    gemms = {("fused", "all-linear"): 4, ("in_place", "all-linear"): 8 if pack else 15,
             ("in_place", "q_proj,v_proj,down_proj"): 6}[weights, targets]          # per layer per token
    assert per_step and set(per_step) == {gemms * len(now) + 1}                         # + the head
    assert (len(watch.copies) > 0) == (weights == "fused")                            # in_place: no weight copied
    engine.load_weights(lora.engine_weights(model))                          # shared weights: nothing to copy


def test_packed_base_trains_saves_and_is_the_reference(random_model_dir, tmp_path):
    """After decode_weights=in_place re-packs the storage (FastDecoder(weights="in_place")): a training step moves
    the adapters alone, the reference is still the frozen base bit for bit, checkpoints and final/ hold only the
    adapters, and final/merged is the same folder as before packing (shared storage saved once per tensor)."""
    from transformers import AutoModelForCausalLM
    from checkpoint import StateDictOptions, _trained_state
    from engines.decode_weights import base_weight
    from engines.fast_decode import FastDecoder
    from models import completion_logprobs, load_model
    model, tok = lora_model(random_model_dir, targets="q_proj,v_proj")   # k, gate, up: plain Linears, packed too
    lora.save_merged(model, tok, str(tmp_path / "before"))
    dec = FastDecoder(model, use_graph=False, weights="in_place")
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert base_weight(q).untyped_storage().nbytes() > base_weight(q).nbytes        # packed: a view
    lora.save_merged(model, tok, str(tmp_path / "after"))
    before, after = (load_file(tmp_path / d / "model.safetensors") for d in ("before", "after"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    ids, mask = batch(tok)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "after")
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids, attention_mask=mask).logits,
                              model(input_ids=ids, attention_mask=mask).logits, atol=1e-5)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    completion_logprobs(model, ids, mask, 4)[0].mean().backward()
    opt.step()
    assert all(torch.equal(p, frozen[n]) and p.grad is None for n, p in model.named_parameters() if n in frozen)
    base, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        assert torch.equal(completion_logprobs(lora.AdaptersOff(model), ids, mask, 4)[0],
                           completion_logprobs(base.eval(), ids, mask, 4)[0])
    state = _trained_state(model, StateDictOptions(full_state_dict=True))
    model.save_pretrained(tmp_path / "final")
    model.double().float()                        # a move (as .to(device)): every weight in storage of its own
    assert base_weight(q).untyped_storage().nbytes() == base_weight(q).nbytes
    dec.refresh()                                 # packs again before the next rollout
    assert base_weight(q).untyped_storage().data_ptr() == dec.fused[0][0][0][0].data_ptr()
    assert state and all("lora_" in k for k in list(state) + list(load_file(tmp_path / "final" / "adapter_model.safetensors")))


def test_bad_lora_input_is_one_line(random_model_dir, tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"lora.targets qq_proj match no module; the model's linear layers are: "
                                        r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        lora_model(random_model_dir, targets="q_proj,qq_proj")
    model, tok = lora_model(random_model_dir)
    model.save_pretrained(tmp_path / "adapter")          # an adapter folder loads as a peft-carrying model
    tok.save_pretrained(tmp_path / "adapter")
    from models import load_model
    carrying, _ = load_model(str(tmp_path / "adapter"), torch.device("cpu"), torch.float32)
    for r in (0, 4):   # full fine-tuning of it is refused too: save_pretrained would write the adapter alone
        with pytest.raises(UserError, match="already carries a peft adapter"):
            lora.wrap(carrying, LoRAConfig(r=r), "x")
    from config import Config
    from config_checks import validate
    cfg = Config()
    cfg.lora.r = -1
    with pytest.raises(UserError, match="'lora.r' must be >= 0"):
        validate(cfg)
    cfg.lora.r = 4
    with pytest.raises(UserError, match="parallel=replicate"):   # two FSDP ranks: the adapters are not sharded
        validate(cfg, world=2)
    from offload import cpu_note
    cfg.offload_optimizer = True
    cfg.lora.r, cfg.offload = 0, True
    monkeypatch.setenv("RANK", "0")   # as under torchrun
    with pytest.raises(UserError, match="offload=true already keeps AdamW state in CPU memory"):
        validate(cfg)
    cfg.offload = False
    assert cpu_note(cfg, torch.device("cpu")).startswith("note: the offload options (offload_optimizer) do nothing")


def rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(NOISE)} for line in f][1:]


def small(out, *extra):
    # the shipped model (its rewards vary, so the adapters move); the reference path too (kl); two mini-batches
    # per step: the optimizer state matters between them
    return [f"out_dir={out}", "steps=3", "prompts_per_step=4", "samples_per_prompt=4", "eval_every=3", "eval_size=8",
            "arithmetic.n_train=200", "arithmetic.n_eval=20", "save_every=2", "algo.minibatch_size=8",
            "algo.kl_coef=0.05", "lora.r=4", "lr=1e-2", "threads=1", "progress=false", *extra]


def test_lora_resume_is_exact_and_checkpoints_hold_only_adapters(tmp_path):
    """A run cut after step 2 and resumed gives the uninterrupted run's numbers (the kill points themselves are
    tests/test_checkpoint.py's; in-process runs here skip three interpreter starts)."""
    import train
    train.main(small(tmp_path / "base"))
    train.main(small(tmp_path / "cut", "steps=2"))                   # ends with a checkpoint at step 2
    saved = load_file(tmp_path / "cut" / "checkpoints" / "step_000002" / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)               # the frozen base is not state
    train.main(small(tmp_path / "cut"))                              # out_dir holds a checkpoint: resumes
    no_eval = lambda rs: [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rs]
    got, want = no_eval(rows(tmp_path / "cut")), no_eval(rows(tmp_path / "base"))
    assert got == want and want[-1]["kl"] > 0                        # the adapters moved off the base
    assert (tmp_path / "base" / "final" / "adapter_model.safetensors").exists()


def test_offload_options_change_memory_not_losses(tmp_path):
    """Same seeded run with every offload option on and off: the same numbers (on GPU the tensors really move)."""
    import train
    on = ["offload_models=true", "offload_optimizer=true", "engine_sleep=true"]
    for name, flags in {"off": [], "on": on, "lora_on": ["lora.r=4", *on]}.items():
        args = small(tmp_path / name, "steps=2", "save_every=0", "algo.name=ppo", *flags)
        if name != "lora_on":
            args.remove("lora.r=4")
        train.main(args)
    assert rows(tmp_path / "on") == rows(tmp_path / "off")
    assert all(math.isfinite(r["loss"]) for r in rows(tmp_path / "lora_on"))   # LoRA's reference needs no visit


@pytest.mark.parametrize("fused", [False, True])
def test_streamed_optimizer_step_is_the_whole_step(fused):
    """offload_optimizer's step (offload.streamed_step): the optimizer runs once per chunk of parameters, their
    state parked in CPU homes between chunks; three steps over two param groups give bit-equal weights and
    state, and a checkpoint's view (`resident`) sees the same state. Chunks of one parameter each."""
    import offload
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    twin = copy.deepcopy(model)
    make = lambda m: torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 3e-2}],
                                       lr=1e-2, weight_decay=0.1, fused=fused)
    plain, streamed = make(model), make(twin)
    calls, step = [], streamed.step   # what each run of the optimizer's own step saw
    streamed.step = lambda *a, **kw: (calls.append([len(g["params"]) for g in streamed.param_groups]), step())
    offload.stream(streamed, torch.device("cpu"), chunk_bytes=1)
    x = torch.randn(5, 8)
    for _ in range(3):
        for m, opt in ((model, plain), (twin, streamed)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    assert calls == [[1, 0], [1, 0], [0, 1], [0, 1]] * 3                    # one parameter at a time
    assert [len(g["params"]) for g in streamed.param_groups] == [2, 2]     # the groups are whole again
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain.state[p][k], streamed.state[q][k])
    homes = streamed.offload_homes
    assert len(homes) == 8 and all(streamed.state[q][k] is homes[(id(q), k)] for q in twin.parameters()
                                   for k in ("exp_avg", "exp_avg_sq"))       # the state lives in its homes
    with offload.resident(streamed):
        assert torch.equal(streamed.state_dict()["state"][3]["exp_avg"], plain.state_dict()["state"][3]["exp_avg"])


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_is_set_for_adapters_on_a_gpu_only(random_model_dir, tf32):
    """lora.tf32 moves the adapters' float32 GEMMs to TF32 on a GPU; a CPU run keeps full float32 (what the
    exactness tests here rely on), and tf32=false keeps it everywhere."""
    import run_setup
    from config import Config
    before = torch.get_float32_matmul_precision()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.set_float32_matmul_precision("highest")
        cfg = Config(model=random_model_dir, lora=LoRAConfig(r=4, tf32=tf32))
        run_setup.build_models(cfg, device, torch.float32, fsdp=False)
        want = "high" if tf32 and device.type == "cuda" else "highest"
        assert torch.get_float32_matmul_precision() == want
    finally:
        torch.set_float32_matmul_precision(before)


def run_with_lora_tf32(model_dir, out) -> dict:
    import train
    return train.main([f"model={model_dir}", f"out_dir={out}", "steps=1", "eval_every=1", "eval_size=4",
                       "prompts_per_step=2", "samples_per_prompt=2", "lora.r=4", "lora.tf32=true", "threads=1",
                       "progress=false"])


def test_tf32_precision_ends_with_the_run(random_model_dir, tmp_path, monkeypatch):
    """lora.tf32 changes the float32 matmul precision for its own run only: after train.main it is what it was
    (it leaked into the next test of the process once). On CPU the option sets nothing, so the GPU branch is
    played by build_models here; the GPU twin below runs the real one."""
    import run_setup
    seen = []

    def build_models(cfg, device, *args):
        out = build(cfg, device, *args)
        if cfg.lora.tf32:
            torch.set_float32_matmul_precision("high")                # as on a GPU
        seen.append(torch.get_float32_matmul_precision())
        return out

    build = run_setup.build_models
    monkeypatch.setattr(run_setup, "build_models", build_models)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        run_with_lora_tf32(random_model_dir, tmp_path / "run")
        assert seen == ["high"] and torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_precision_ends_with_the_run_on_a_gpu(random_model_dir, tmp_path):
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        run_with_lora_tf32(random_model_dir, tmp_path / "run")
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
