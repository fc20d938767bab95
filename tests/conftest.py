"""Shared fixtures: a tiny random transformers model saved locally (no hub needed)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_random_model(path: str, seed: int = 0, vocab_chars: str = "0123456789+="):
    """A 2-layer Qwen2 with a character tokenizer (ids: <pad>=0, <eos>=1, then the chars)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(vocab_chars)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs requirements-vllm.txt (scripts/ci_vllm.sh); skipped without it")


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    return make_random_model(str(tmp_path_factory.mktemp("random-model")))
