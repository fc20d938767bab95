"""Kernel implementations chosen by name (kernels.choose, the registry's "kernel" kind): every registered
implementation of every op gives the torch twin's values through the op's entry point, on CPU (the Triton ones,
Liger's included where it is installed, under the interpreter in a subprocess); bad names are one-line errors."""
import importlib.util
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels  # noqa: E402
from registry import RegistryError  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402

TOL = 2e-5   # float32 kernels against float32 torch: rounding apart, never compared exactly


@pytest.fixture(autouse=True)
def restore_choice():
    before = kernels.choose()
    yield
    kernels.choose(**before)


def grads(outputs, inputs, seed=1):
    """Gradients of a random weighting of every output, so each output's backward is checked."""
    g = torch.Generator().manual_seed(seed)
    total = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outputs)
    return list(torch.autograd.grad(total, inputs))


def run_logprob():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 33, generator=g) * 3).requires_grad_()            # (B, T, V)
    targets = torch.randint(0, 33, (3, 5), generator=g)
    targets[1, 2] = -100                                                            # padded: 0, no gradient
    logp, ent = kernels.token_logprobs(logits, targets, 0.7)
    return [logp, ent, *grads([logp, ent], [logits])]


def run_linear_logprob():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 12, generator=g).requires_grad_()                   # (B, T, H)
    weight = torch.randn(33, 12, generator=g).requires_grad_()                     # (V, H)
    targets = torch.randint(0, 33, (2, 5), generator=g)
    targets[0, 4] = -100
    logp, ent = kernels.linear_logprobs(hidden, weight, targets, 0.7)
    return [logp, ent, *grads([logp, ent], [hidden, weight])]


def run_logprob_loss():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, 12, generator=g).requires_grad_()                   # (B, C, H)
    weight = torch.randn(33, 12, generator=g).requires_grad_()
    targets = torch.randint(0, 33, (3, 4), generator=g)
    targets[2, 3] = -100
    a, b = -(torch.rand(3, 4, generator=g) + 0.5), torch.rand(3, 4, generator=g) + 0.5   # (B, C) each
    loss, logp, ent = kernels.linear_logprob_loss_kernel(hidden, weight, targets, 0.7,
                                                         lambda rows, lp, en: (lp * a[rows] + en * b[rows]).sum(),
                                                         rows_per_chunk=2)
    return [loss, logp.detach(), ent.detach(), *torch.autograd.grad(loss, [hidden, weight])]


def run_sample():
    """Samplers draw from different noise (Philox in the kernels, torch's in the twin), so their draws differ;
    what they share: rows with one dominant token pick it, and every logp is the drawn token's log-prob."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 33, generator=g)                                        # (B, V)
    logits[:4, 7] = 60.0                                                            # rows 0-3: token 7, p ~ 1
    inv_t = torch.tensor([1 / 0.7])
    out = []
    for method in ("gumbel", "cdf"):
        tok, logp = kernels.sample_token(logits, inv_t, torch.tensor([3]), torch.tensor([1]), method=method)
        want = torch.log_softmax(logits * inv_t, -1).gather(1, tok[:, None])[:, 0]   # (B,)
        assert torch.allclose(logp, want, atol=TOL), (method, logp, want)
        out += [tok[:4], logp[:4]]
    return out


def run_decode_attention():
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, S, D = 2, 4, 2, 20, 16
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=g)
    k, v = torch.randn(B, nkv, S, D, generator=g), torch.randn(B, nkv, S, D, generator=g)   # caches
    cos, sin = torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)
    key_ok = torch.rand(B, S, generator=g) > 0.3
    o = kernels.decode_attention_kernel(qkv, cos, sin, torch.tensor([5, 11]), k, v, key_ok, torch.tensor([13]),
                                        1 / math.sqrt(D))
    return [o, k, v]                                                                # the cache write too


RUNS = {"logprob": run_logprob, "linear_logprob": run_linear_logprob, "logprob_loss": run_logprob_loss,
        "sample": run_sample, "decode_attention": run_decode_attention}


def check_all(names=None) -> list[str]:
    """Each registered implementation of each op (those named, default all whose packages are installed) against
    the op's torch twin; -> "op.name" of those checked."""
    checked = []
    for op, run in RUNS.items():
        kernels.choose(**{op: "torch"})
        want = run()
        for name in kernels.implementations(op):
            needs = getattr(kernels.get("kernel", f"{op}.{name}"), "needs", ())
            if (names and name not in names) or any(importlib.util.find_spec(p) is None for p in needs):
                continue
            kernels.choose(**{op: name})
            for i, (a, b) in enumerate(zip(run(), want, strict=True)):
                assert a.shape == b.shape and a.dtype == b.dtype, (op, name, i)
                assert torch.allclose(a, b, atol=TOL, rtol=TOL), (op, name, i, (a - b).abs().max())
            checked.append(f"{op}.{name}")
        kernels.choose(**{op: "auto"})
    return checked


def test_every_op_has_its_torch_twin_and_a_triton_version():
    assert set(RUNS) == set(kernels.OPS)
    for op in kernels.OPS:
        assert {"torch", "triton"} <= set(kernels.implementations(op)), op


def test_torch_implementations_on_cpu():
    assert check_all(["torch"]) == [f"{op}.torch" for op in RUNS]
    assert kernels.use_triton(torch.zeros(1)) == (os.environ.get("TRITON_INTERPRET") == "1")   # auto: torch here


def test_triton_and_other_implementations_interpreted():
    """Every implementation but the twins, under TRITON_INTERPRET=1: Triton's always, Liger's where installed."""
    liger = importlib.util.find_spec("liger_kernel") is not None
    run_interpreted(f"""
import tests.test_kernel_registry as t
checked = t.check_all([n for n in ("triton", "liger") if n != "liger" or {liger}])
assert sorted(checked) == {sorted([f"{op}.triton" for op in RUNS] + (["logprob.liger"] if liger else []))}, checked
print("ok")""")


def test_bad_choices_are_one_line_errors(monkeypatch):
    with pytest.raises(RegistryError) as e:
        kernels.choose(logprob="cuda")
    assert str(e.value) == "kernels.logprob must be one of auto, liger, torch, triton; got 'cuda'"
    with pytest.raises(RegistryError, match="unknown kernel op 'softmax'; ops: logprob, linear_logprob"):
        kernels.choose(softmax="torch")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "liger_kernel" else real(n, *a))
    with pytest.raises(RegistryError, match="needs the liger_kernel package.*pip install liger-kernel"):
        kernels.choose(logprob="liger")
    assert kernels.choose() == dict.fromkeys(kernels.OPS, "auto")   # a refused choice changes nothing
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RegistryError, match="need a CUDA device"):
            kernels.choose(sample="triton")
        kernels.choose(decode_attention="torch")
        assert kernels.choose()["decode_attention"] == "torch"


def test_config_names_every_op():
    from config import KernelsConfig
    assert list(vars(KernelsConfig())) == list(kernels.OPS)


def test_ablate_compares_kernels_like_algorithms(tmp_path, monkeypatch):
    """--kernels OP=A,B expands to one entry per implementation on the first --runs entry; the table gets each
    entry's mean update time (runs faked here: tests/test_offline_and_ablate.py runs train.py for real)."""
    from tools import ablate
    launched = []

    def fake_launch(entry, seed, out, common, save_every, progress=""):
        launched.append((entry, seed, tuple(common)))
        t = 0.5 if entry.endswith("=torch") else 0.25
        rows = [{"step": 0, "eval/accuracy": 0.1}] + [{"step": s, "reward": 0.5, "eval/accuracy": 0.2,
                                                       "time/update": t * (3 if s == 1 else 1)} for s in (1, 2, 3)]
        return {"entry": entry, "seed": seed, "rows": rows, "wall_s": 1.0}
    monkeypatch.setattr(ablate, "launch", fake_launch)
    text = ablate.main(["--runs", "rloo,grpo", "--kernels", "logprob=torch,triton", "--seeds", "0,1",
                        "--out", str(tmp_path), "steps=3"])
    entries = ["rloo:kernels.logprob=torch", "rloo:kernels.logprob=triton"]
    assert sorted(launched) == sorted((e, s, ("steps=3",)) for e in entries for s in (0, 1))
    rows = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines() if line.startswith("| `")}
    assert list(rows) == [f"`{e}`" for e in entries]
    assert rows[f"`{entries[0]}`"][-2].strip() == "0.5000" and rows[f"`{entries[1]}`"][-2].strip() == "0.2500"
    assert "indistinguishable" in rows[f"`{entries[1]}`"][9]          # the same accuracy on both seeds


@pytest.mark.parametrize("arg, message", [("kernels.sample=fast", "error: kernels.sample must be one of auto, "),
                                          ("logger=mlflow", "error: config key 'logger' takes a comma list of ")])
def test_train_refuses_a_bad_kernel_or_logger_in_one_line(arg, message, tmp_path):
    from conftest import script_here
    r = script_here("train.py", [arg, f"out_dir={tmp_path / 'run'}"])   # its __main__ block, in this process
    assert r.returncode == 2 and r.stderr.startswith(message) and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()                            # before any work
