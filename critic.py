"""The critic for algorithms that declare `needs_critic` (PPO): a value model with its own optimizer.

    critic = Critic(cfg, device, dtype, fsdp)           # the policy's backbone + a Linear(H, 1) head
    values = critic.values(input_ids, attention_mask, completion_mask)      # (B, C) V(s_t) per completion token
    critic.optimizer.zero_grad(); new["values"] = critic.values(..., grad=True)   # per update; the loss trains it
    critic.step()                                       # clip, step and zero its own gradients

The value model is `AutoModelForTokenClassification(num_labels=1)` loaded from the policy's folder: the
same backbone weights (a warm start that already "reads" the task) and a fresh 1-unit head, zero-initialised
so the first values are 0 and the first advantages are the plain returns. V(s_t), the value before token t,
is read from the hidden state that predicts token t (position P + t - 1), as the policy's log-prob is.
Under torchrun with parallel=fsdp (or offload=true) the critic is sharded as the policy is (distributed.shard:
float32 masters, compute in the config dtype, FSDP reducing its gradients); with parallel=replicate every rank
holds it whole and train.py averages its gradients (distributed.average_gradients).
"""
import warnings

import torch
from torch import Tensor

import distributed
from config import UserError
from models import position_ids


class Critic:
    def __init__(self, cfg, device: torch.device, dtype: torch.dtype, fsdp: bool = False):
        from transformers import AutoModelForTokenClassification
        from transformers.utils import logging as hf_logging
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()          # the fresh head is expected: no "newly initialized" table
        try:
            self.model = AutoModelForTokenClassification.from_pretrained(   # fsdp: float32 masters, as the policy's
                cfg.model, num_labels=1, dtype=torch.float32 if fsdp else dtype)
        except (OSError, ValueError) as e:   # e.g. an architecture without a token-classification class
            raise UserError(f"cannot build a critic from '{cfg.model}': {str(e).splitlines()[0]}")
        finally:
            hf_logging.set_verbosity(level)
        head = getattr(self.model, "score", None) or self.model.classifier
        torch.nn.init.zeros_(head.weight)
        if getattr(head, "bias", None) is not None:
            torch.nn.init.zeros_(head.bias)
        # transformers puts a dropout (p = 0.1 unless the config says otherwise) before the value head, and train
        # mode would apply it to every value: noisy V(s) for GAE and for the value loss, different on every call
        for module in self.model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        if fsdp:   # memory: a second full model and its AdamW state would otherwise sit on every rank
            self.model = distributed.shard(self.model, device, dtype, cfg.offload)
            # the score head's (B, T, 1) output is a view of its matmul's; values() only reads it (no in-place op
            # that would skip FSDP's pre-backward hook), so torch's warning about that does not apply
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        else:
            self.model.to(device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.algo.ppo.critic_lr,
                                           weight_decay=cfg.weight_decay)
        self.grad_clip = cfg.grad_clip

    def values(self, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, grad: bool = False) -> Tensor:
        """(B, T) ids and mask, (B, C) completion mask -> (B, C) values of the states before each completion token."""
        C = completion_mask.shape[1]
        with torch.set_grad_enabled(grad):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids(attention_mask), use_cache=False)
        return out.logits[:, -C - 1:-1, 0].float() * completion_mask                       # (B, C)

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return distributed.grad_norm_value(norm)   # sharded: the norm over every rank's shard
