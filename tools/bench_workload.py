"""The workload every part of tools/bench.py shares (docs/benchmarks.md): the shapes, the random Qwen2 model and its
digit tokenizer, the random-digit prompts, and the timing helpers. tools/bench.py sets W from --shape / --small
before any part reads it; tools/bench_w4.py and tools/gpu_memory.py read the same dict.
"""
import time

import torch

SHAPES = {  # Qwen2.5-0.5B, and a toy version for the CPU smoke run
    "w1": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, prompts=16, samples=8, prompt_len=64, new=256),
    "w6": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, prompts=8, samples=8, prompt_len=64, new=256, tied=False),
    "small": dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, prompts=4, samples=2, prompt_len=8, new=8),
}
W = dict(SHAPES["w1"])      # the shape in use; set from --small before anything reads it


def prompt_texts(n: int, seed: int = 0) -> list[str]:
    """n prompts of W['prompt_len'] random digits: one token per digit under the bench tokenizer (transformers
    loads it as a Qwen2 tokenizer, whose pre-tokenizer splits digits one by one, so its encoding is certain)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 10, (n, W["prompt_len"]), generator=g)        # no '0': see build_model
    return ["".join(str(i) for i in row.tolist()) for row in ids]


def build_model(path: str, dtype: torch.dtype):
    """A random Qwen2 at W's shape + a tokenizer with ids 0-9 = the digits, every other id a word 't<i>' (so any
    sampled id decodes), and <eos> = vocab_size: outside the model's vocabulary, so it is never sampled."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    V = W["vocab_size"]
    vocab = {**{str(i): i for i in range(10)}, **{f"t{i}": i for i in range(10, V)}, "<eos>": V}
    t = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="0", eos_token="<eos>")
    torch.manual_seed(0)
    shape = {k: W[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads")}
    # pad_token_id=None: with a pad id the embedding row is zero-initialised, and a sequence that starts with
    # that token keeps an exactly-zero residual stream through every layer; RMSNorm's Jacobian there is
    # 1/sqrt(eps) = 1000 per layer, so its gradient overflows to inf/nan in a 24-layer random model (seen on
    # an H100 with TRL and with this project alike).
    cfg = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=W.get("tied", True), eos_token_id=V,
                      pad_token_id=None, bos_token_id=None)
    # built on the GPU in the target dtype when there is one: a 7B model's float32 init on the CPU takes minutes
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            Qwen2ForCausalLM(cfg).save_pretrained(path)
    finally:
        torch.set_default_dtype(default)
    tok.save_pretrained(path)


def cuda_info() -> dict:
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    return {"device": torch.cuda.get_device_name(), "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load(a):
    from models import load_model
    return load_model(a.model, torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                      torch.bfloat16 if torch.cuda.is_available() else torch.float32)


def timed(fn, repeats: int) -> tuple[float, list[float], object]:
    """First call (warm-up: compile, capture) time, then the times of `repeats` more calls; last result."""
    out, times = None, []
    for _ in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times[0], times[1:], out
