"""Per-stage GPU memory: what each stage of a step does not need leaves the GPU while that stage runs.

    python train.py algo.kl_coef=0.05 offload_models=true        # the reference model lives in CPU memory
    python train.py offload_optimizer=true                       # AdamW state off the GPU during the rollout
    python train.py engine=vllm engine_sleep=true                # vLLM sleeps through each update (GPU)

A step's stages want different things resident (train.py: train_step):
    rollout     policy weights + KV cache                 -> optimizer state in CPU memory (offload_optimizer),
                                                              critic parked (offload_models)
    logprobs    policy, reference, critic forwards        -> the reference visits the GPU for its forward only
    update      policy + gradients                        -> the engine sleeps (engine_sleep); the optimizer
                                                              state comes to the GPU ~1 GiB at a time, inside
                                                              each optimizer step (offload_optimizer)
Every option is off by default and changes where tensors live, never their values: losses are the same on or
off (tests/test_lora.py). The cost is the copies: the reference's weights go host -> GPU once per step (from
pinned memory, and they are frozen, so nothing comes back); the critic and the optimizer state go both ways
(the state once per optimizer step, from and into pinned buffers kept for the run).
On CUDA, `profiling.phase` logs each stage's peak allocated memory as mem/<stage>_gib and `memory_table`
prints them at the end, so the effect of each option is visible in the run's own log.
On a CPU run the options have nothing to move: setup prints a note and the run goes on.
"""
import contextlib
import functools

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


# A streamed optimizer step (offload_optimizer) brings this much optimizer state to the GPU at once. The whole
# state never is: at 7B under FSDP2 on two 80 GB cards (bf16 engine copy 14 GiB + fp32 shard 14 + its gradient
# 14 + the decoder's fused copies 8.5 per rank) AdamW's 28 GiB per rank would not fit beside the gradients.
CHUNK_BYTES = 1 << 30


def _local(v: torch.Tensor) -> torch.Tensor:
    """The tensor that holds v's data: this rank's shard of an FSDP2 DTensor, else v itself."""
    return getattr(v, "_local_tensor", v)


def _set_local(state: dict, key: str, data: torch.Tensor):
    """Point state[key] at `data`. A DTensor keeps its identity (its mesh, placements and global shape) and only
    its shard moves: a DTensor cannot be rebuilt around a CPU shard of a CUDA mesh, and the parked shard is
    touched by nothing but `unpark` (checkpoints call `resident` first)."""
    if hasattr(state[key], "_local_tensor"):
        state[key]._local_tensor = data
    else:
        state[key] = data


def _moving(state: dict) -> list[str]:
    """The state entries that move: the moments. Scalars (the step count) stay where AdamW keeps them."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]


def park(optimizer, params, homes: dict):
    """Each parameter's optimizer state into its CPU home: pinned buffers made at the first park and reused,
    so later parks and unparks copy at full bus speed and pin nothing new. The copies are queued on the current
    stream; the GPU memory they read is reused only by work queued after them."""
    for p in params:
        state = optimizer.state.get(p, {})
        for k in _moving(state):
            t = _local(state[k])
            home = homes.get((id(p), k))
            if home is None:
                home = homes[(id(p), k)] = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            if t is not home:
                home.copy_(t, non_blocking=True)
                _set_local(state, k, home)


def unpark(optimizer, params, device: torch.device):
    for p in params:
        state = optimizer.state.get(p, {})
        for k in _moving(state):
            _set_local(state, k, _local(state[k]).to(device, non_blocking=True))


def _chunks(params: list, chunk_bytes: int) -> list[list]:
    """Consecutive parameters whose optimizer state (two moments in the parameter's dtype) is ~chunk_bytes."""
    out, size = [[]], 0
    for p in params:
        if size >= chunk_bytes:
            out, size = out + [[]], 0
        out[-1].append(p)
        size += 2 * _local(p).numel() * _local(p).element_size()
    return out


def streamed_step(optimizer, step, device: torch.device, homes: dict, chunk_bytes: int = CHUNK_BYTES):
    """One optimizer step with the state in CPU memory: `step` (the optimizer's own) runs once per chunk of
    parameters, the param groups narrowed to that chunk, its state on `device` only meanwhile. AdamW updates
    each parameter from its own gradient and state alone, so the chunks give exactly the one whole step."""
    groups = [g["params"] for g in optimizer.param_groups]
    every = [p for ps in groups for p in ps]
    park(optimizer, every, homes)        # state that arrived whole (a resumed checkpoint) leaves first
    try:
        for chunk in _chunks(every, chunk_bytes):
            ids = {id(p) for p in chunk}
            for g, ps in zip(optimizer.param_groups, groups):
                g["params"] = [p for p in ps if id(p) in ids]
            unpark(optimizer, chunk, device)
            step()
            park(optimizer, chunk, homes)
    finally:
        for g, ps in zip(optimizer.param_groups, groups):
            g["params"] = ps
    if device.type == "cuda":
        torch.cuda.synchronize(device)   # the last copies into the homes are done before anyone reads them


def stream(optimizer, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
    """Make `optimizer.step()` a streamed step (its state lives in CPU memory from now on). The instance's
    step is replaced, not the class's; the original (the LR scheduler's counting wrapper) runs per chunk."""
    step, homes = optimizer.step, {}

    @functools.wraps(step)   # keeps the scheduler's mark on its wrapper (else a warning says step was overridden)
    def streamed(*a, **kw):
        streamed_step(optimizer, lambda: step(*a, **kw), device, homes, chunk_bytes)

    optimizer.step = streamed
    optimizer.offload_device, optimizer.offload_homes = device, homes


@contextlib.contextmanager
def resident(optimizer):
    """A streamed optimizer's whole state on its device inside the block (checkpoint.py gathers FSDP2 state
    there: a parked DTensor's shard is in CPU memory and cannot be gathered), in CPU memory again after."""
    device = getattr(optimizer, "offload_device", None)
    if device is None:
        yield
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unpark(optimizer, params, device)
    try:
        yield
    finally:
        park(optimizer, params, optimizer.offload_homes)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class Stages:
    """The moves between stages that the offload_* options and engine_sleep ask for (train.py calls these)."""

    def __init__(self, cfg, device: torch.device, learner, engine):
        self.cfg, self.device, self.learner, self.engine = cfg, device, learner, engine
        self.gpu = device.type == "cuda"
        self.notes: list[str] = []    # what engine.sleep/wake said the first time (printed once by train.py)
        if self.gpu and cfg.offload_models and learner.critic is not None:
            learner.critic.model.to("cpu")   # starts parked: the rollout comes first
        if self.gpu and cfg.offload_optimizer:
            for opt in self.optimizers():
                stream(opt, device)

    def for_experience(self):
        """Before the log-prob / value forwards: the critic comes back (offload_models)."""
        if self.gpu and self.cfg.offload_models and self.learner.critic is not None:
            self.learner.critic.model.to(self.device)
            if not self.cfg.offload_optimizer:   # (streamed, its state stays in CPU memory)
                move_optimizer_state(self.learner.critic.optimizer, self.device)

    def for_update(self):
        """Before the update: the engine sleeps (engine_sleep)."""
        if self.cfg.engine_sleep:
            said = self.engine.sleep()
            if not self.notes:
                self.notes.append(said)

    def after_update(self):
        """After the update: the critic leaves the GPU; the engine wakes for the weight sync."""
        if self.gpu and self.cfg.offload_models and self.learner.critic is not None:
            self.learner.critic.model.to("cpu")
            if not self.cfg.offload_optimizer:
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
