"""activation_budget (issue 38): how much of each compiled layer's activations the backward keeps rather than
recomputes changes memory, never the maths. compile=true partitions each layer's forward and backward with torch's
min-cut partitioner, which reads the budget; the backend aot_eager_decomp_partition runs that same partition
without inductor's code generation, so these take seconds on a CPU."""
import pytest
import torch
import torch._functorch.config

import config
import config_checks
import run_setup
from models import load_model


def step(model, ids):
    """One forward and backward; -> (loss, {name: grad}, bytes of activations saved for the backward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):   # weights (and views of them) are saved too, but they are not activations
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits                                          # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved.values())


def test_budget_keeps_the_gradients_and_sets_the_memory(random_model_dir):
    """Budgets 0 (recompute all it can, the grad_checkpointing default) and 0.5 against the eager model: the same
    loss and gradients; the saved activations grow with the budget, and stay under eager's (which keeps them all)."""
    ids = torch.randint(2, 14, (4, 24), generator=torch.Generator().manual_seed(0))   # (B, T)
    eager, eager_grads, everything = step(load_model(random_model_dir, torch.device("cpu"), torch.float32)[0], ids)
    saved = {}
    for budget in (0.0, 0.5):
        torch._dynamo.reset()
        model = load_model(random_model_dir, torch.device("cpu"), torch.float32)[0]
        model.model.layers[0].compile(backend="aot_eager_decomp_partition")   # one layer: one compile per budget
        with torch._functorch.config.patch(activation_memory_budget=budget):
            loss, grads, saved[budget] = step(model, ids)
        assert loss == pytest.approx(eager, rel=1e-6), budget
        for name, g in eager_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"{name} at budget {budget}")
    torch._dynamo.reset()
    assert saved[0.0] < saved[0.5] < everything, (saved, everything)


def test_setup_hands_the_budget_to_the_partitioner(random_model_dir):
    """build_models sets torch's activation_memory_budget from the config: activation_budget with
    grad_checkpointing and compile, 1 (keep what compile keeps) without grad_checkpointing."""
    before = torch._functorch.config.activation_memory_budget
    try:
        for flags, want in ((["grad_checkpointing=true", "activation_budget=0.25"], 0.25),
                            (["grad_checkpointing=true"], 0.0), ([], 1.0)):
            cfg = config.fill_defaults(config.parse([f"model={random_model_dir}", "compile=true", *flags]))
            config_checks.validate(cfg)
            run_setup.build_models(cfg, torch.device("cpu"), torch.float32, fsdp=False)
            assert torch._functorch.config.activation_memory_budget == want, flags
    finally:
        torch._functorch.config.activation_memory_budget = before
        torch._dynamo.reset()


@pytest.mark.parametrize("flags, message", [
    (["activation_budget=1.5"], r"'activation_budget' must be in \[0, 1\]"),
    (["activation_budget=-0.1"], r"'activation_budget' must be in \[0, 1\]"),
    (["activation_budget=0.5", "compile=true"], "needs grad_checkpointing=true compile=true"),
    (["activation_budget=0.5", "grad_checkpointing=true", "compile=true", "compiled_recompute=false"],
     "needs grad_checkpointing=true compile=true"),
    (["activation_budget=0.5", "grad_checkpointing=true", "compile=true", "memory_budget_gib=20"],
     "assumes activation_budget=0"),
])
def test_bad_budget_refused_in_one_line(flags, message):
    with pytest.raises(config.UserError, match=message) as e:
        config_checks.validate(config.fill_defaults(config.parse(flags)))
    assert "\n" not in str(e.value)
