"""Per-stage GPU memory: what each stage of a step does not need leaves the GPU while that stage runs.

    python train.py algo.kl_coef=0.05 offload_models=true        # the reference model lives in CPU memory
    python train.py offload_optimizer=true                       # AdamW state off the GPU during the rollout
    python train.py engine=vllm engine_sleep=true                # vLLM sleeps through each update (GPU)

A step's stages want different things resident (train.py: train_step):
    rollout     policy weights + KV cache                 -> optimizer state parked (offload_optimizer),
                                                              critic parked (offload_models)
    logprobs    policy, reference, critic forwards        -> the reference visits the GPU for its forward only
    update      policy + gradients + optimizer state      -> the engine sleeps (engine_sleep)
Every option is off by default and changes where tensors live, never their values: losses are the same on or
off (tests/test_lora.py). The cost is the copies: the reference's weights go host -> GPU once per step (from
pinned memory, and they are frozen, so nothing comes back); the critic and the optimizer state go both ways.
On CUDA, `profiling.phase` logs each stage's peak allocated memory as mem/<stage>_gib and `memory_table`
prints them at the end, so the effect of each option is visible in the run's own log.
On a CPU run the options have nothing to move: setup prints a note and the run goes on.
"""
import contextlib

import torch


def cpu_note(cfg, device) -> str | None:
    """The one line a CPU run prints when it was given options that only move memory between CPU and GPU."""
    on = [k for k in ("offload_models", "offload_optimizer") if getattr(cfg, k)]
    if device.type == "cpu" and on:
        return f"note: the offload options ({', '.join(on)}) do nothing on a CPU run: everything is in CPU memory already"
    return None


def pin(model):
    """Keep a frozen model in pinned CPU memory: its visits to the GPU copy at full bus speed."""
    if torch.cuda.is_available():
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.pin_memory()
    return model


@contextlib.contextmanager
def visit(model, device: torch.device, enabled: bool):
    """A frozen model (the reference) on `device` inside the block; its CPU tensors are kept and put back after,
    so nothing is copied back (it did not change) and the GPU copy is freed when the block ends."""
    if not enabled or model is None or device.type == "cpu":
        yield
        return
    home = [(t, t.data) for t in list(model.parameters()) + list(model.buffers())]
    for t, data in home:
        t.data = data.to(device, non_blocking=True)
    try:
        yield
    finally:
        for t, data in home:
            t.data = data


def move_optimizer_state(optimizer, device: torch.device):
    """Every tensor of the optimizer's state (AdamW's moments and step counts) to `device`, in place in the
    state dict: the parameters keep their identity, so the next step finds its state where it looks."""
    for state in optimizer.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.device != device:
                state[k] = v.to(device, non_blocking=True)


class Stages:
    """The moves between stages that the offload_* options and engine_sleep ask for (train.py calls these)."""

    def __init__(self, cfg, device: torch.device, learner, engine):
        self.cfg, self.device, self.learner, self.engine = cfg, device, learner, engine
        self.gpu = device.type == "cuda"
        self.notes: list[str] = []    # what engine.sleep/wake said the first time (printed once by train.py)
        if self.gpu and cfg.offload_models and learner.critic is not None:
            learner.critic.model.to("cpu")   # starts parked: the rollout comes first

    def for_experience(self):
        """Before the log-prob / value forwards: the critic comes back (offload_models)."""
        if self.gpu and self.cfg.offload_models and self.learner.critic is not None:
            self.learner.critic.model.to(self.device)
            move_optimizer_state(self.learner.critic.optimizer, self.device)

    def for_update(self):
        """Before the update: the engine sleeps (engine_sleep), the optimizer state comes back."""
        if self.cfg.engine_sleep:
            said = self.engine.sleep()
            if not self.notes:
                self.notes.append(said)
        if self.gpu and self.cfg.offload_optimizer:
            for opt in self.optimizers():
                move_optimizer_state(opt, self.device)

    def after_update(self):
        """After the update: optimizer state and critic leave the GPU; the engine wakes for the weight sync."""
        if self.gpu and self.cfg.offload_optimizer:
            for opt in self.optimizers():
                move_optimizer_state(opt, torch.device("cpu"))
        if self.gpu and self.cfg.offload_models and self.learner.critic is not None:
            self.learner.critic.model.to("cpu")
            move_optimizer_state(self.learner.critic.optimizer, torch.device("cpu"))
        if self.cfg.engine_sleep:
            said = self.engine.wake()
            if len(self.notes) == 1:
                self.notes.append(said)

    def optimizers(self) -> list:
        critic = self.learner.critic
        return [self.learner.optimizer] + ([critic.optimizer] if critic is not None else [])


STAGES = ("rollout", "logprobs", "reward", "update", "sync")   # train_step's phases, in order


def memory_table(rows: list[dict]) -> str | None:
    """The per-stage peak-memory table of a run (the largest mem/<stage>_gib over its steps), or None on CPU."""
    stages = [s for s in STAGES if any(f"mem/{s}_gib" in r for r in rows)]
    if not stages:
        return None
    top = lambda key: max(r.get(key, 0.0) for r in rows)
    lines = ["peak GPU memory by stage (max over steps): allocated / reserved"]
    lines += [f"  {s:<9} {top(f'mem/{s}_gib'):7.2f} / {top(f'mem/{s}_reserved_gib'):7.2f} GiB" for s in stages]
    return "\n".join(lines)
