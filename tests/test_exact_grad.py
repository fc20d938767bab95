"""update.ExactValues: under exact_logprobs the loss reads the exact forward's bits and differentiates the ordinary
forward (the exact forward's small blocks are never kept for autograd: at W1's shape they filled a 140 GB card)."""
import torch

from update import ExactValues


def test_values_are_exact_bits_and_gradient_is_the_ordinary_forwards():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, generator=g, requires_grad=True)
    ordinary = torch.log_softmax(w, -1)                                              # (4, 6)
    exact = (ordinary.detach() + 1e-3 * torch.randn(4, 6, generator=g)).contiguous()   # other bits, same meaning
    out = ExactValues.apply(ordinary, exact)
    assert torch.equal(out, exact)                                                   # bit for bit, not a + (b - a)
    weights = torch.randn(4, 6, generator=g)
    (out * weights).sum().backward()
    want, = torch.autograd.grad((torch.log_softmax(w, -1) * weights).sum(), w)
    assert torch.equal(w.grad, want)
