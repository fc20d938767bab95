"""Loading the policy and getting per-token log-probs out of it.

`load_model` takes a local folder or a hub id (any transformers causal LM); the embedded default is the
project's own tiny checkpoint in assets/tiny-model. `completion_logprobs` is the one forward pass every
stage uses (old, reference and training log-probs), so they cannot drift apart.
"""
import os

import torch
from torch import Tensor

import distributed
import vision
from config import UserError
from kernels import linear_logprob_loss_kernel, linear_logprobs, token_logprobs


def position_ids(attention_mask: Tensor) -> Tensor:
    # left padding shifts where a sequence starts; positions count real tokens only
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def setup_device(cfg) -> tuple[torch.device, torch.dtype]:
    """The device (this rank's GPU under torchrun) and the model dtype the config asks for."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.device == "auto":
        device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]   # config_checks.validate checked it
    return device, dtype


def load_model(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()            # our own progress bar is the only one on screen
    path = os.path.expanduser(name)
    # a hub id is 'org/name'; anything else that names a path must exist here
    if not os.path.exists(path) and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise UserError(f"model path '{name}' does not exist")
    # a folder without config.json is no transformers model; left to transformers, an empty one fails in the
    # tokenizer with "You need to have sentencepiece or tiktoken installed"
    # (a peft adapter folder, adapter_config.json, loads too: transformers fetches its base)
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in ("config.json", "adapter_config.json")):
        raise UserError(f"model folder '{name}' holds no config.json: not a transformers model folder "
                        "(save_pretrained writes config.json, the weights and the tokenizer files)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = (AutoModelForImageTextToText if _is_vlm(AutoConfig, path) else AutoModelForCausalLM).from_pretrained(
            path, dtype=dtype)
    except (OSError, ValueError) as e:   # ValueError: files transformers cannot read (e.g. no tokenizer)
        raise UserError(f"cannot load model '{name}': {str(e).strip().splitlines()[0]}")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.to(device), tok


def _is_vlm(auto_config, path: str) -> bool:
    """Does the folder hold a vision-language model (vision.py)? A folder without a config (a peft adapter) is not."""
    try:
        return hasattr(auto_config.from_pretrained(path), "vision_config")
    except (OSError, ValueError):
        return False


def encode_prompts(tok, prompts: list[str], rendered: list[bool] | None = None) -> list[list[int]]:
    """Prompt strings -> token ids; chat models get their chat template (with the generation prompt),
    except prompts the task already rendered with one (rendered[i] True)."""
    rendered = rendered or [False] * len(prompts)
    if getattr(tok, "chat_template", None):
        # render to text first: apply_chat_template(tokenize=True) returns a list in transformers 4, a dict in 5
        prompts = [p if done else tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                          tokenize=False) for p, done in zip(prompts, rendered)]
    return [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]


def context_length(model) -> int:
    """The longest sequence the model takes; a VLM's config keeps its decoder's in text_config. Unbounded when the
    config names none."""
    c = model.config
    text = c.get_text_config() if hasattr(c, "get_text_config") else c
    return getattr(c, "max_position_embeddings", None) or getattr(text, "max_position_embeddings", None) or 1 << 30


def plain_head(model) -> bool:
    """Are the logits exactly hidden @ lm_head.weight.T (no bias, soft-capping or scale)? Then the fused kernel
    can take the hidden states instead."""
    head, c = model.get_output_embeddings(), model.config
    # what transformers' causal-LM heads apply after the matmul: gemma's soft-capping, cohere's logit_scale,
    # granite's logits_scaling (a divisor: with it, the kernel's output would be divided instead of logits)
    return (type(head) is torch.nn.Linear and head.bias is None and not getattr(c, "final_logit_softcapping", None)
            and getattr(c, "logit_scale", None) is None and getattr(c, "logits_scaling", 1.0) in (None, 1.0))


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, C: int,
                        temperature: float = 1.0, images: dict | None = None) -> tuple[Tensor, Tensor]:
    """Teacher-forced log-probs and entropies of the last C tokens: (B, T) ids -> two (B, C) tensors.
    images: a vision batch's pictures (Experience.images()), placed on the prompt's image tokens (episodes: on the
    prompt's and the observations' ones their image_mask names)."""
    targets = input_ids[:, -C:]
    if not plain_head(model):
        logits = model(**_inputs(input_ids, attention_mask, C, model, images)).logits[:, :-1]      # (B, C, V)
        return token_logprobs(logits, targets, temperature)
    # speed/memory: the fused kernel goes from hidden states to log-probs; the (B, C, V) logits (2.5 GB per
    # 32 x 256 tokens at V = 152k in bf16, twice with their gradient) never exist
    # memory: the head's gradient goes straight into its .grad (see kernels/linear_logprob.py); under FSDP2,
    # which owns the gradients (its reduce-scatter hooks wait for them), autograd hands them over as usual
    into_grad = not distributed.is_sharded(model)
    return _in_head(model, input_ids, attention_mask, C, lambda h, w: linear_logprobs(h, w, targets, temperature, into_grad),
                    images)


def completion_loss(model, input_ids: Tensor, attention_mask: Tensor, C: int, temperature: float,
                    loss_fn, images: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The policy loss of the last C tokens with its gradient taken inside the log-prob kernel
    (kernels/logprob_loss.py: one lm_head matmul fewer than log-probs + autograd). loss_fn(rows: slice,
    logp (b, C), entropy (b, C)) -> those rows' share of the loss. Returns (loss, logp, entropy), the last two
    detached (B, C). Heads that are not plain get log-probs by autograd and one loss_fn call on every row."""
    if not plain_head(model):
        logp, entropy = completion_logprobs(model, input_ids, attention_mask, C, temperature, images)
        return loss_fn(slice(0, len(input_ids)), logp, entropy), logp.detach(), entropy.detach()
    targets = input_ids[:, -C:]
    into_grad = not distributed.is_sharded(model)   # as in completion_logprobs
    return _in_head(model, input_ids, attention_mask, C,
                    lambda h, w: linear_logprob_loss_kernel(h, w, targets, temperature, loss_fn, into_grad=into_grad),
                    images)


def _inputs(input_ids: Tensor, attention_mask: Tensor, C: int, model=None, images: dict | None = None) -> dict:
    # pictures: their features replace the prompt's image tokens (the completion's C columns are text), or for
    # episodes those image_mask names, observations included (vision.slots)
    ids = dict(input_ids=input_ids) if images is None else \
        vision.model_inputs(model, input_ids, images, prompt_len=input_ids.shape[1] - C)
    pos = vision.positions(model, input_ids, attention_mask, images, input_ids.shape[1] - C)   # M-RoPE: (3, B, T)
    return dict(**ids, attention_mask=attention_mask, position_ids=pos,
                logits_to_keep=C + 1, use_cache=False)        # position t predicts token t + 1


def _in_head(model, input_ids: Tensor, attention_mask: Tensor, C: int, fn, images: dict | None = None) -> tuple:
    """Run the model with fn(hidden (B, C, H), head weight) in the lm_head's place; its outputs come back where
    the logits would. Inside the model's own forward: under FSDP2 that is where the root unit's weights
    (embeddings, the tied head) are gathered, and where the root's backward hooks see the head's gradient."""
    head = model.get_output_embeddings()
    # clones: FSDP2 hooks the root's outputs for backward, and an in-place op on a view (the kernels return
    # views) would bypass that hook (torch warns on every such output)
    head.forward = lambda hidden: tuple(t.clone() for t in fn(hidden[:, :-1], head.weight))   # (B, C + 1, H) in
    try:
        return tuple(model(**_inputs(input_ids, attention_mask, C, model, images)).logits)
    finally:
        del head.forward                                # the head's own forward again (generate, save, ...)
