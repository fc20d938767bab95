"""Build the project's tiny vision-language model: a Qwen2-VL from transformers' config classes with a tiny vision
tower, a character tokenizer, transformers' PIL image processor, and a short supervised warm start on task=shapes.

    python tools/make_tiny_vlm.py                       # writes assets/tiny-vlm/ (minutes on 2 idle CPU cores)
    python tools/make_tiny_vlm.py --out /tmp/vlm --steps 50 --threads 1      # a quick, untrained-ish copy (tests)

The result loads with `AutoModelForImageTextToText.from_pretrained(out)`, `AutoTokenizer.from_pretrained(out)` and
vision.image_processor(out); `python train.py --config configs/vision.yaml` trains it with RL. The script ends by
printing the held-out accuracy (greedy and sampled at temperature 1.0) of what it wrote.

Why a sloppy teacher (as tools/make_tiny_model.py): each supervised answer is right with probability
`teacher_accuracy`, else the answer of a bad habit, decided once per example. Counting, the habit counts every
circle, blue ones too; comparing sizes, it names the shape drawn first (higher up, then further left), whatever
its size. The warm start thus sees the pictures well enough to answer but mostly answers with the habit: greedy,
it is right where the habit happens to agree with the truth, and a sample at temperature 1 is right more often
than that. The samples of one prompt disagree, so GRPO's group advantages carry signal, and held-out accuracy
rises when the policy learns to drop the habit. The supervised rows come from the train side of the task's split.

Why captions too: from one answer character per picture, the tiny tower did not learn to see in 600 steps (the
loss stayed at the blind model's). A `caption_share` of the supervised rows ask "describe?" instead and get the
picture's caption, one character per grid cell (`caption`), always right: dense supervision of every image token,
as real VLMs learn to see from captions before they answer questions. RL never asks for a caption.

Shape: Qwen2VLForConditionalGeneration; text: hidden 64, 2 layers, 2 heads of 32, MLP 256, tied embeddings;
vision: patch 8, 2 x 2 merge, 2 blocks of width 64. A 64 x 64 picture is 8 x 8 patches, 16 image tokens: one per
cell of the task's 4 x 4 grid. Positions: the project's text positions, not M-RoPE (config `text_positions`,
vision.uses_mrope), for the tiny model learns either and the text ones cost nothing.
"""
import argparse
import ast
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch  # noqa: E402
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration  # noqa: E402

import vision  # noqa: E402
from engines.base import SamplingParams  # noqa: E402
from engines.builtin import BuiltinEngine  # noqa: E402
from models import encode_prompts  # noqa: E402
from rewards.vision import vision_reward  # noqa: E402
from tasks import shapes  # noqa: E402
from tools.make_tiny_model import build_tokenizer, checked_warm_start_args, warm_start  # noqa: E402

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz ?"
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
VIDEO_TOKEN = "<|video_pad|>"
CAPTION = f"{shapes.IMAGE}describe?"   # the warm start's second question (sft_batch), never asked in RL


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="assets/tiny-vlm", help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed for init, SFT data and eval sampling")
    p.add_argument("--steps", type=int, default=600, help="SFT optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="SFT sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (linear warmup, cosine decay)")
    p.add_argument("--teacher_accuracy", type=float, default=0.3,
                   help="probability that an SFT answer is right rather than the habit's")
    p.add_argument("--caption_share", type=float, default=0.5,
                   help="share of SFT rows that ask for the picture's caption (always right) instead of the question")
    p.add_argument("--n_eval", type=int, default=200, help="held-out rows to evaluate at the end")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    return checked_warm_start_args(p)


def build(out: str):
    """Tokenizer, image processor and a randomly initialised model, the first two saved to out."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tok = build_tokenizer(CHARS)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.model_max_length = 128
    side = shapes.SIZE * shapes.SIZE   # every picture resized to 64 x 64: 16 image tokens
    proc = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=side, max_pixels=side)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, **special,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True, **special)
    cfg.text_positions = True   # trained on the project's text positions, not M-RoPE (vision.uses_mrope)
    # vLLM's Qwen2-VL processor looks the video token up by name even for pictures (engine=vllm): the tokenizer
    # knows it, outside the model's vocabulary (no prompt of the project holds it, the model never samples it)
    tok.add_tokens([VIDEO_TOKEN], special_tokens=True)
    os.makedirs(out, exist_ok=True)
    tok.save_pretrained(out)
    proc.save_pretrained(out)
    cfg.save_pretrained(out)   # vision.image_processor reads the family from it (the warm start encodes rows first)
    return tok, Qwen2VLForConditionalGeneration(cfg).float()


def habit(row: dict) -> str:
    """The bad habit's answer: every circle counted; the shape drawn first named."""
    scene = ast.literal_eval(row["scene"])   # the task's own repr of a dict of lists, tuples, str and int
    if scene["kind"] == "count":
        return str(sum(kind.endswith("circle") for kind, _ in scene["items"]))
    first = min(range(2), key=lambda i: (scene["at"][i][1], scene["at"][i][0]))
    return "ab"[first]


def caption(row: dict) -> str:
    """What the picture shows, cell by cell of the task's grid (row-major): r red circle, b blue circle, s red
    square, c circle, q square, o empty; a size comparison ends with the circle's and the square's size / 2."""
    scene = ast.literal_eval(row["scene"])
    cells = ["o"] * shapes.GRID ** 2
    at = scene["at"] if scene["kind"] == "larger" else [xy for _, xy in scene["items"]]
    names = [k for k, _ in scene["items"]]
    for name, (x, y) in zip(names, at):
        cells[y // shapes.CELL * shapes.GRID + x // shapes.CELL] = {
            "red circle": "r", "blue circle": "b", "red square": "s", "circle": "c", "square": "q"}[name]
    sizes = " " + "".join(str(size // 2) for _, size in scene["items"]) if scene["kind"] == "larger" else ""
    return "".join(cells) + sizes


def sft_batch(rows, tok, out: str, teacher_accuracy: float, caption_share: float, rng: random.Random):
    """-> ids (B, T) right-padded, labels (B, T) (-100 but on answers), attention mask, the batch's pictures.
    A caption_share of the rows ask for the caption instead (CAPTION): dense, always right supervision of every
    image token, from which the tiny tower learns to see in far fewer steps than from one answer character."""
    kinds = [rng.random() < caption_share for _ in rows]
    prompts = vision.encode_rows(tok, out, [{**r, "prompt": CAPTION} if c else r for r, c in zip(rows, kinds)],
                                 encode_prompts)
    seqs = []
    for p, r, c in zip(prompts, rows, kinds):
        answer = caption(r) if c else r["answer"] if rng.random() < teacher_accuracy else habit(r)
        c = tok.encode(answer) + [tok.eos_token_id]
        seqs.append((list(p) + c, [-100] * len(p) + c))
    T = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), T), tok.pad_token_id)                            # (B, T)
    labels, mask = torch.full((len(seqs), T), -100), torch.zeros(len(seqs), T, dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids, labels, mask, vision.batch_images(prompts, 1)


def sft(model, tok, args):
    rng = random.Random(f"sft-{args.seed}")
    train = shapes.shapes_samples(shapes.N_TRAIN, heldout=False, seed=args.seed + 1)   # not the RL train rows

    def loss_at(step):
        ids, labels, mask, images = sft_batch(rng.sample(train, args.batch), tok, args.out, args.teacher_accuracy,
                                              args.caption_share, rng)
        # the same embedding and positions as rollout and training use (vision.embed, vision.positions)
        logits = model(inputs_embeds=vision.embed(model, ids, images), attention_mask=mask,
                       position_ids=vision.positions(model, ids, mask, images), use_cache=False).logits   # (B, T, V)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    warm_start(model, args.steps, args.lr, 25, loss_at)


@torch.no_grad()
def accuracy(model, tok, out: str, rows: list[dict], temperature: float, seed: int) -> float:
    engine = BuiltinEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    prompts = vision.encode_rows(tok, out, rows, encode_prompts)
    gen = torch.Generator().manual_seed(seed)
    rollout = engine.generate(prompts, 1, SamplingParams(max(temperature, 1e-5), 1.0, 4), gen)
    C = rollout.completion_mask.shape[1]
    texts = [tok.decode(r[-C:][:int(n)].tolist(), skip_special_tokens=True)
             for r, n in zip(rollout.input_ids, rollout.completion_mask.sum(-1))]
    return sum(vision_reward(r["prompt"], t, **{k: v for k, v in r.items() if k != "prompt"})
               for r, t in zip(rows, texts)) / len(rows)


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok, model = build(args.out)
    sft(model, tok, args)
    model.eval()
    model.save_pretrained(args.out)
    held = shapes.shapes_samples(args.n_eval, heldout=True)
    result = {"greedy": accuracy(model, tok, args.out, held, 0.0, args.seed),
              "sampled_t1": accuracy(model, tok, args.out, held, 1.0, args.seed)}
    with open(os.path.join(args.out, "make_tiny_vlm.json"), "w") as f:
        json.dump({"args": vars(args), "held_out_accuracy": result}, f, indent=1)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"held-out accuracy: greedy {result['greedy']:.3f}, sampled at T=1 {result['sampled_t1']:.3f}; "
          f"{size / 1e6:.1f} MB in {args.out}")


if __name__ == "__main__":
    main()
