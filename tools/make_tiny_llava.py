"""Build a tiny random LLaVA-style model: transformers' LlavaForConditionalGeneration over a tiny CLIP vision tower and a
tiny llama, a character tokenizer with the `<image>` token, and a LlavaProcessor whose image-token count is fixed.

    python tools/make_tiny_llava.py --out /tmp/tiny-llava      # ~0.5 MB, seconds; random weights, no warm start

It exists to test that a second VLM family runs through the same code as Qwen2-VL (vision.py: `Llava`;
tests/test_vision_llava.py): rollout, teacher forcing, GRPO steps, the frozen encoder, LoRA. It learns nothing
useful (random weights); tools/make_tiny_vlm.py is the warm-started Qwen2-VL.

Shape: vision: CLIP, 64 x 64 pictures in patches of 16 (4 x 4 = 16 patches and a CLS token), width 32, 2 layers;
the projector (2 Linear layers) maps its last layer's patch features (strategy "default": CLS dropped) to the text
width, so every picture is 16 `<image>` tokens; text: llama, hidden 64, 2 layers, 2 heads of 32, MLP 128, tied
embeddings, plain 1-D positions. The processor resizes and crops any picture to 64 x 64 (task=shapes draws 64 x 64).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch  # noqa: E402

from tools.make_tiny_model import build_tokenizer  # noqa: E402

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz ?"
IMAGE_TOKEN = "<image>"   # LLaVA's image token; also the rows' slot (vision.IMAGE), which vision.py expands to 16 of it
SIDE, PATCH = 64, 16


def build(out: str, seed: int = 0):
    """Tokenizer, processor and a random model, all saved to out. -> (tokenizer, model)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    try:   # transformers >= 5.2x names the PIL image processor apart (the default one needs torchvision)
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor
    tok = build_tokenizer(CHARS)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.model_max_length = 128
    images = ImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    # num_additional_image_tokens=1: CLIP's CLS, which strategy "default" drops again: (64 / 16)^2 = 16 tokens
    proc = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH, image_token=IMAGE_TOKEN,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=SIDE, patch_size=PATCH, projection_dim=32),
        text_config=LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                tie_word_embeddings=True, **special),
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_seq_length=(SIDE // PATCH) ** 2, tie_word_embeddings=True,
        **special)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).float()
    os.makedirs(out, exist_ok=True)
    tok.save_pretrained(out)
    proc.save_pretrained(out)
    model.save_pretrained(out)
    return tok, model


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args()
    build(args.out, args.seed)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"tiny LLaVA: {size / 1e6:.1f} MB in {args.out}")


if __name__ == "__main__":
    main()
