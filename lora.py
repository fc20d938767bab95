"""LoRA through peft: only low-rank adapters train; the frozen base serves as the reference model.

    python train.py lora.r=16 lr=1e-3                       # r=16 adapters on every linear layer but lm_head
    python train.py lora.r=8 lora.targets=q_proj,v_proj     # only these modules (names as in the model)
    python train.py lora.r=16 lora.save_merged=true         # final/ holds the adapter, final/merged/ the merged model

A LoRA layer computes y = x W^T + (x A^T B^T) * alpha / r with W frozen and A (r, in), B (out, r) trained;
B starts at zero, so step 0 is the base model exactly. What the rest of the loop sees:
- Training: the policy is peft's PeftModel; the optimizer gets only the adapters (requires_grad), and
  checkpoints hold only them (checkpoint.py leaves frozen parameters out: they come from `model=`).
  peft keeps the adapters in float32 beside a bf16 base (its autocast_adapter_dtype), which AdamW wants.
  On a GPU their products then run as float32 GEMMs; `lora.tf32` (on by default) puts them on TF32 tensor
  cores: 10 mantissa bits, still finer than the bf16 base beside them (7), and without it the plain-float32
  GEMMs were a quarter of W6's update on an H100 (docs/lora.md).
- Reference: `AdaptersOff(policy)` runs the same modules inside peft's `disable_adapter()`: every LoRA layer
  then calls its base layer alone, so the reference log-probs are the frozen base's bit for bit, with no
  second copy of the weights.
- Rollout: the built-in engine's fast decoder merges W + B A * alpha / r into its own fused buffers once per
  rollout (`dense_weight`, engines/decode_weights.py: refresh), so each decode step costs what the plain model's
  does; the plain loop (CPU) runs the peft model itself. The base weights are never merged in place: in bf16,
  merge-then-unmerge does not give W back, and the reference would drift. decode_weights=in_place copies
  nothing: it re-packs the frozen base weights' storage (each becomes a view of its projection group's buffer,
  values and Parameters unchanged) and adds the adapters beside each group (engines/decode_weights.py: pack_group).
- vLLM (and any engine holding its own copy) gets `engine_weights(policy)`: the merged tensors under the
  transformers names, in place.
- Saving: final/ is peft's adapter folder (adapter_config.json + adapter_model.safetensors; PeftModel or
  transformers with peft installed load it over the base); lora.save_merged adds final/merged/, a plain
  transformers folder (vLLM loads it too).
Simplified: one adapter ("default"); under torchrun only parallel=replicate (config_checks.validate).
"""
import contextlib
import os
import warnings

import torch
from torch import Tensor

import vision
from config import UserError


@contextlib.contextmanager
def run_scoped_precision():
    """torch's float32 matmul precision as it was before, once the block (or the decorated function) ends, however
    it ends: lora.tf32 sets it for its own run only (run_setup.py: build_models), not for what the process runs next
    (tests run many trainings in one process)."""
    before = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def is_peft(model) -> bool:
    """A peft PeftModel, or a transformers model that loaded an adapter (its peft integration)."""
    return hasattr(model, "peft_config") or bool(getattr(model, "_hf_peft_config_loaded", False))


def linear_names(model) -> list[str]:
    """The distinct last parts of the names of the model's Linear layers (what lora.targets may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def wrap(model, section, model_name: str):
    """The model with LoRA adapters (section: config.LoRAConfig), or the model itself for r = 0.
    A model that already carries an adapter is refused either way: full fine-tuning would train the adapter
    together with the base, and save_pretrained would write the adapter alone."""
    if is_peft(model):
        raise UserError(f"model '{model_name}' already carries a peft adapter: train its base (model=<base>) or "
                        "merge the adapter first (peft's merge_and_unload, or a run's final/merged)")
    if section.r == 0:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("lora.r > 0 needs peft: pip install 'peft>=0.13'") from None
    if section.targets == "all-linear":
        targets = "all-linear"   # peft's own choice: every Linear but the output layer
    else:
        targets = [t.strip() for t in section.targets.split(",") if t.strip()]
        known = linear_names(model)
        missing = [t for t in targets if t not in known]
        if missing or not targets:
            raise UserError(f"lora.targets {','.join(missing) or repr(section.targets)} match no module; the model's "
                            f"linear layers are: {', '.join(known)} (or lora.targets=all-linear)")
    config = LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout, target_modules=targets,
                        bias="none", task_type="CAUSAL_LM", exclude_modules=vision.tower_linears(model) or None)
    with warnings.catch_warnings():   # peft 0.21 reads a transformers attribute that 5.x marks deprecated
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


class AdaptersOff(torch.nn.Module):
    """The base model, seen through the peft policy with its adapters switched off for each call: the reference
    model without a second copy. It exposes what models.completion_logprobs reads (forward, config, the head)."""

    def __init__(self, peft_model):
        super().__init__()
        object.__setattr__(self, "peft", peft_model)   # not a submodule: its parameters belong to the policy

    @property
    def config(self):
        return self.peft.config

    def get_output_embeddings(self):
        return self.peft.get_output_embeddings()

    def forward(self, **kwargs):
        with self.peft.disable_adapter():
            return self.peft(**kwargs)


def dense_weight(linear) -> Tensor:
    """The weight a Linear applies: its own, or for a peft LoRA layer W + B A * alpha / r, a new tensor in W's
    dtype (the sum in float32, so one rounding). Disabled or already merged adapters add nothing."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    w = base.weight
    active = [a for a in linear.active_adapters if a in getattr(linear, "lora_A", {})]
    if linear.disable_adapters or linear.merged or not active:
        return w
    with torch.no_grad():
        delta = sum(linear.get_delta_weight(a).float() for a in active)                # (out, in)
        return (w.float() + delta).to(w.dtype)


def engine_weights(model):
    """(transformers name, tensor) pairs for an engine that holds its own copy (vLLM's load_weights): a plain
    model's parameters as they are; a peft model's merged, one layer at a time (at most one merged weight
    exists beside the engine's copy), with the adapters themselves left out."""
    if not hasattr(model, "peft_config"):
        yield from model.named_parameters()
        return
    base = model.get_base_model()
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            owner, kind = name.rsplit(".base_layer.", 1)
            yield f"{owner}.{kind}", dense_weight(base.get_submodule(owner)) if kind == "weight" else p
        else:
            yield name, p


def save_merged(model, tok, path: str):
    """A plain transformers folder of the merged model at path (written to path.tmp, then renamed)."""
    import shutil
    base = model.get_base_model()
    state = {name: t.detach().cpu().contiguous() for name, t in engine_weights(model)}
    # the base's own save_pretrained: its config, its tied-weight handling; the adapters are not in `state`
    base.save_pretrained(path + ".tmp", state_dict=state)
    tok.save_pretrained(path + ".tmp")
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(path + ".tmp", path)


def describe(model) -> str:
    """One line: trained and total parameter counts."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"LoRA: training {trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)"
