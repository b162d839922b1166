"""The saved-activation tracker (metrics/memory.py SavedActivations) the pipeline, pipedream and megatron
engines measure activations with: it must count what autograd keeps and keep nothing itself."""

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from raytrain_par.metrics.memory import SavedActivations


class _Attention(torch.nn.Module):
    """Softmax saves its own output: the case where a tracker holding the saved tensor holds the graph."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv, self.out, self.d = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), d

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.d, dim=-1)
        return x + self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


def test_a_split_backward_leaves_nothing_saved_step_after_step():
    """Zero-bubble schedules run the input half of a backward keeping the graph for the weight half.
    After both halves, nothing the forward saved may stay counted, nor alive: otherwise every step
    adds a microbatch's activations for good (what the tracker did before it saved detached tensors)."""
    torch.manual_seed(0)
    module, tracker = _Attention(), SavedActivations()
    after = []
    for _ in range(3):
        x = torch.randn(4, 8, 16, requires_grad=True)
        with tracker.track(module.parameters()):
            y = module(x)
        saved = tracker.now
        _, groups = stage_backward_input([y.square().mean()], None, [x], module.parameters())
        stage_backward_weight(module.parameters(), groups)
        del y, groups
        after.append(tracker.now)
    assert saved > 0
    assert after == [0, 0, 0]


def test_the_split_backward_gives_the_gradients_of_a_plain_one():
    """What the tracker hands back to autograd (detached tensors) computes the same gradients."""
    torch.manual_seed(0)
    module, tracker = _Attention(), SavedActivations()
    x = torch.randn(4, 8, 16, requires_grad=True)
    module(x).square().mean().backward()
    want = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    module.zero_grad()
    x.grad = None
    with tracker.track(module.parameters()):
        y = module(x)
    _, groups = stage_backward_input([y.square().mean()], None, [x], module.parameters())
    stage_backward_weight(module.parameters(), groups)
    for got, expected in zip([p.grad for p in module.parameters()] + [x.grad], want):
        torch.testing.assert_close(got, expected)
