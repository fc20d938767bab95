"""Images in the loop: from a task row's picture to the vision encoder's embeddings in the prompt (docs/vision.md).

    prompt_ids = encode_rows(tok, model_path, rows, encode_prompts)   # rows with "image": ImagePrompt lists
    images = batch_images(prompt_ids, n)      # {} for text prompts; else the Experience's image fields
    embeds = embed(model, input_ids, images)  # (B, T, H) token embeddings, image pads replaced by image features

Layout. A prompt's picture travels once: `ImagePrompt` is the prompt's token-id list carrying its picture (raw
bytes or a path, turned into pixels only where a forward needs them), so the sampler, the engine and the
evaluation pass it along as any prompt. An experience batch holds one row of pixels per distinct picture,
`pixel_values` (U, N, D) with `image_grid_thw` (U, 3) for a Qwen2-VL, (U, 3, H, W) and no grid for a LLaVA, and
`image_index` (B,) names each sample's picture: the n samples of a prompt share one. `embed` runs the vision
encoder once per distinct picture and scatters its features over the image-pad tokens of every row that shows it.

Several pictures per row (multi-turn episodes, engines/multiturn.py: the prompt's and the observations'):
`image_index` is then (B, K), each row's pictures in the order they appear, -1 after its last, and `image_mask`
(B, T) marks the image pads that show them: the renderer's, never a pad the policy sampled (that one is text).
Without `image_mask` the pictures sit on the image pads of the first prompt_len columns (single turn).

Positions: a Qwen2-VL reading pictures gets its M-RoPE positions (`positions`), the same in the engine and the
trainer; a model trained on text positions says so in its config (`text_positions`, the tiny VLM).
Families (FAMILIES, by config.model_type): what differs between VLM layouts (the picture's fields, its image tokens,
the encoder's modules and call, M-RoPE or not) is a small class each (`QwenVL`, `Llava`); a VLM of another layout is
refused in one line naming the known ones (`check_config`, before any work).
What it simplifies: a single-turn prompt shows one picture; pictures never come from the policy; no videos.
"""
import io
import os
from functools import lru_cache

import torch
from torch import Tensor

IMAGE = "<image>"                # the rows' image slot (tasks/shapes.py)
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")   # Experience fields indexed by picture, not by row


class ImagePrompt(list):
    """A prompt's token ids with the picture they show (`image`: PNG/JPEG bytes or a path) and the processor
    that turns it into pixels."""

    def __init__(self, ids, image, processor):
        super().__init__(ids)
        self.image, self.processor = image, processor


def load_image(image, decode: bool = True):
    """bytes or a path -> an RGB PIL image (decode=False: opened lazily, enough for its size). A parquet image column
    written by HF datasets holds {"bytes": ..., "path": ...}: its bytes, else its path."""
    from PIL import Image
    if isinstance(image, dict) and set(image) <= {"bytes", "path"}:
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray)):
        img = Image.open(io.BytesIO(image))
        return img.convert("RGB") if decode else img
    if isinstance(image, str) and os.path.exists(image):
        return Image.open(image).convert("RGB") if decode else Image.open(image)
    raise ValueError(f"a row's image must be bytes, an existing file path or a datasets image dict, got "
                     f"{type(image).__name__}")


class QwenVL:
    """Qwen2-VL, Qwen2.5-VL: a picture is N patch rows (N, D) with its grid (t, h, w); one image token per merge x merge
    patches, framed by <|vision_start|> ... <|vision_end|>; the encoder `visual` holds its projector (the merger);
    M-RoPE positions."""
    encoder = ("visual",)                          # model.model's modules from pixels to features (frozen, no LoRA)
    fields = ("pixel_values", "image_grid_thw")    # the picture table's fields
    mrope = True
    vllm = fsdp = True                             # engines/vllm.py and distributed.shard know its layout

    @staticmethod
    def load_processor(path: str):
        """transformers' PIL image processor: the default (torchvision) one is not installable here."""
        try:   # transformers >= 5.2x names the PIL processor apart; older ones load it as the default slow one
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
        except ImportError:
            from transformers import Qwen2VLImageProcessor as cls
        return cls.from_pretrained(path)

    @staticmethod
    def owns(processor) -> bool:
        return hasattr(processor, "merge_size")

    @staticmethod
    def pixels(processor, img) -> dict:
        """-> pixel_values (N, D), image_grid_thw (3,)."""
        out = processor(images=[img], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"][0]}

    @staticmethod
    def text(processor, img) -> str:
        """Start marker, one pad per merged patch, end marker."""
        grid = processor(images=[img], return_tensors="pt")["image_grid_thw"][0]
        return "<|vision_start|>" + "<|image_pad|>" * (int(grid.prod()) // processor.merge_size ** 2) + "<|vision_end|>"

    @staticmethod
    def features(model, images: dict, weight: Tensor) -> list[Tensor]:
        """Each picture of the table -> its (n_u, H) features (the encoder once over all of them)."""
        pv, grid = images["pixel_values"], images["image_grid_thw"]
        flat = torch.cat([p[:n] for p, n in zip(pv, grid.prod(-1).tolist())])          # (sum N, D)
        out = model.get_image_features(flat.to(weight.device, weight.dtype), grid.to(weight.device))
        feats = getattr(out, "pooler_output", out)     # 5.2x: an output with a tuple of (n_u, H); older: a tensor
        merge = model.config.vision_config.spatial_merge_size ** 2
        return list(feats) if isinstance(feats, (list, tuple)) else list(feats.split(
            [n // merge for n in grid.prod(-1).tolist()]))


class Llava:
    """LLaVA-style (transformers' LlavaForConditionalGeneration): a CLIP-like `vision_tower` and a
    `multi_modal_projector` beside the language model; a picture is one (3, H, W) image at the processor's fixed
    size, no grid; its image token repeated once per feature the tower keeps (the processor's count); plain text
    positions."""
    encoder = ("vision_tower", "multi_modal_projector")
    fields = ("pixel_values",)
    mrope = False
    vllm = fsdp = False   # engines/vllm.py cuts Qwen2-VL's pad run, distributed.shard wraps `visual`: not this layout

    @staticmethod
    def load_processor(path: str):
        """transformers' LlavaProcessor (its image processor, the tokenizer and the image-token count)."""
        from transformers import AutoProcessor
        return AutoProcessor.from_pretrained(path)

    @staticmethod
    def owns(processor) -> bool:
        return hasattr(processor, "image_processor") and hasattr(processor, "image_token")

    @staticmethod
    def pixels(processor, img) -> dict:
        """-> pixel_values (3, H, W)."""
        return {"pixel_values": processor.image_processor(images=[img], return_tensors="pt")["pixel_values"][0]}

    @staticmethod
    def text(processor, img) -> str:
        """The image token as many times as the processor expands it for this picture (CLS and the feature
        strategy included)."""
        ids = processor(text=[processor.image_token], images=[img], return_tensors="pt")["input_ids"][0]
        return processor.image_token * int((ids == processor.image_token_id).sum())

    @staticmethod
    def features(model, images: dict, weight: Tensor) -> list[Tensor]:
        out = model.get_image_features(pixel_values=images["pixel_values"].to(weight.device, weight.dtype))
        feats = getattr(out, "pooler_output", out)     # a list of (n_u, H), or a (U, n, H) tensor
        return list(feats)


# model_type -> layout. A new family: a class like the two above (docs/vision.md, "Adding a model family")
FAMILIES = {"qwen2_vl": QwenVL, "qwen2_5_vl": QwenVL, "llava": Llava}


def unknown(model_type: str) -> str:
    return (f"a vision-language model of model_type {model_type!r}: vision.py knows the layouts of "
            f"{', '.join(FAMILIES)} (docs/vision.md: adding a model family)")


def family_of_config(config):
    """A model config -> its family (FAMILIES); None for a text model; an unknown VLM is a ValueError."""
    if not hasattr(config, "vision_config"):
        return None
    if config.model_type not in FAMILIES:
        raise ValueError(unknown(config.model_type))
    return FAMILIES[config.model_type]


def family(model):
    """The model's family, None for a text model (peft's wrappers looked through)."""
    return family_of_config(base_model(model).config)


def family_of_processor(processor):
    return next(f for f in dict.fromkeys(FAMILIES.values()) if f.owns(processor))   # FAMILIES' order: QwenVL first


@lru_cache(maxsize=4)
def _path_config(model_path: str, local_only: bool = False):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_path, local_files_only=local_only)


def check_config(cfg, world: int = 1):
    """Before any work: a vision-language model whose layout this file does not know, or a path this family does not
    take yet (engine=vllm, FSDP), is a one-line ValueError. A folder that does not read is left to load_model, a hub
    id not in the local cache to `family` once the model is loaded (no network call here)."""
    try:
        config = _path_config(cfg.model, local_only=True)
    except (OSError, ValueError):
        return
    fam = family_of_config(config)
    if fam is None:
        return
    if cfg.engine == "vllm" and not fam.vllm:
        raise ValueError(f"engine=vllm with a {config.model_type} model: engines/vllm.py passes Qwen2-VL's pictures "
                         "only; use engine=builtin (its portable loop takes this family)")
    if world > 1 and cfg.parallel == "fsdp" and not fam.fsdp:
        raise ValueError(f"parallel=fsdp with a {config.model_type} model: distributed.shard gives only Qwen2-VL's "
                         "tower a unit of its own; use parallel=replicate")


@lru_cache(maxsize=4)
def image_processor(model_path: str):
    """The model family's processor (Qwen2-VL: its PIL image processor; LLaVA: its LlavaProcessor)."""
    fam = family_of_config(_path_config(model_path))
    if fam is None:
        raise ValueError(f"rows carry pictures but {model_path} is a text model (no vision_config)")
    return fam.load_processor(model_path)


def picture_fields(processor, image) -> dict:
    """A picture (bytes or a path) -> its fields, unbatched (QwenVL.pixels, Llava.pixels)."""
    return family_of_processor(processor).pixels(processor, load_image(image))


def picture_table(processor, images: list) -> dict:
    """U pictures -> the table's fields: pixel_values (U, N, D) padded to the most patches and image_grid_thw (U, 3)
    (Qwen2-VL), or pixel_values (U, 3, H, W) (LLaVA)."""
    rows = [picture_fields(processor, i) for i in images]
    out = {}
    for k in rows[0]:
        parts = [r[k] for r in rows]
        if k == "pixel_values" and parts[0].dim() == 2:   # patch rows: pad to the most
            N = max(len(x) for x in parts)
            parts = [torch.nn.functional.pad(x, (0, 0, 0, N - len(x))) for x in parts]
        if len({tuple(x.shape) for x in parts}) > 1:
            raise ValueError(f"pictures of different {k} shapes {sorted({tuple(x.shape) for x in parts})}: the "
                             "processor must give one size")
        out[k] = torch.stack(parts)
    return out


def image_tokens(processor, image, by_size: dict) -> str:
    """The text that stands for one picture in the family's layout (QwenVL.text, Llava.text). The count depends on
    the picture's size only: by_size keeps the text per (width, height)."""
    img = load_image(image, decode=False)
    if img.size not in by_size:
        by_size[img.size] = family_of_processor(processor).text(processor, img.convert("RGB"))
    return by_size[img.size]


def encode_rows(tok, model_path: str, rows: list[dict], encode_prompts) -> list[list[int]]:
    """Token ids of each row's prompt; a row with an "image" gets the image slot expanded and its ids become an
    ImagePrompt. A row with an image but no slot (or a slot but no image) is an error."""
    if not any("image" in r for r in rows):
        return encode_prompts(tok, [r["prompt"] for r in rows], [bool(r.get("chat_rendered")) for r in rows])
    proc, by_size = image_processor(model_path), {}
    prompts = []
    for r in rows:
        if ("image" in r) != (r["prompt"].count(IMAGE) == 1):
            raise ValueError(f"a row with an image needs exactly one {IMAGE} in its prompt (and only such a row): "
                             f"{r['prompt'][:60]!r}")
        prompts.append(r["prompt"].replace(IMAGE, image_tokens(proc, r["image"], by_size)) if "image" in r else r["prompt"])
    ids = encode_prompts(tok, prompts, [bool(r.get("chat_rendered")) for r in rows])
    return [ImagePrompt(i, r["image"], proc) if "image" in r else i for i, r in zip(ids, rows)]


def batch_images(prompts: list, n: int) -> dict:
    """The image fields of an experience batch whose rows are n samples of each prompt in turn: one row of pixels
    per prompt. {} when no prompt has a picture."""
    if not any(isinstance(p, ImagePrompt) for p in prompts):
        return {}
    if not all(isinstance(p, ImagePrompt) for p in prompts):
        raise ValueError("a batch mixes prompts with and without pictures (every prompt of a vision task needs one)")
    table = picture_table(prompts[0].processor, [p.image for p in prompts])   # (U, ...) each
    return {**table, "image_index": torch.arange(len(prompts)).repeat_interleave(n)}                   # (B,)


def episode_images(processor, pictures: list[list], image_mask: Tensor) -> dict:
    """Rows' pictures (bytes, each row's in the order they appear) and the (B, T) mask of the image pads that show
    them -> the picture fields: each distinct picture once, pixel_values (U, N, D), image_grid_thw (U, 3);
    image_index (B, K), -1 after a row's last; image_mask. {} when no row shows one."""
    table, index = {}, []
    for row in pictures:
        index.append([table.setdefault(p, len(table)) for p in row])
    if not table:
        return {}
    K = max(len(r) for r in index)
    return {**picture_table(processor, list(table)), "image_mask": image_mask.bool(),
            "image_index": torch.tensor([r + [-1] * (K - len(r)) for r in index], dtype=torch.long)}


def row_pictures(images: dict) -> list[list[int]]:
    """Each row's pictures in order, as rows of the picture table: image_index (B,) or (B, K) with -1 = none."""
    index = images["image_index"]
    index = index[:, None] if index.dim() == 1 else index
    return [[u for u in row if u >= 0] for row in index.tolist()]


def slots(model, input_ids: Tensor, images: dict, prompt_len: int | None = None) -> Tensor:
    """(B, T) bool: the image pads that show a picture. image_mask where the batch has one (episodes: the renderer's
    pads, prompt and observations), else the image pads of the first prompt_len columns (all when None)."""
    if images.get("image_mask") is not None:
        return images["image_mask"].bool().to(input_ids.device)
    out = input_ids == base_model(model).config.image_token_id                           # (B, T)
    if prompt_len is not None:   # a sampled image-pad token in a completion is text, not a picture
        out[:, prompt_len:] = False
    return out


def save_processor(model, model_path: str, out: str):
    """A VLM's final/ folder gets the processor it was trained with, so that it loads as it came."""
    if family(model) is not None:
        image_processor(model_path).save_pretrained(out)


def base_model(model):
    """The transformers model under peft's wrappers (a LoRA policy, lora.AdaptersOff): its tower and embeddings carry
    no adapter, so the picture's features are the same through either."""
    model = getattr(model, "peft", model)                              # lora.AdaptersOff
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def encoder(model) -> list:
    """The modules that turn pixels into the language model's embeddings ([] for a text model): Qwen2-VL's `visual`
    (its merger inside), LLaVA's `vision_tower` and `multi_modal_projector` (the family's `encoder`)."""
    fam = family(model)
    if fam is None:
        return []
    base = base_model(model)
    inner = getattr(base, "model", base)
    return [getattr(inner, name) for name in fam.encoder]


def tower(model):
    """The vision encoder (Qwen2-VL: model.model.visual; LLaVA: model.model.vision_tower); None for a text model."""
    mods = encoder(model)
    return mods[0] if mods else None


def tower_linears(model) -> list[str]:
    """Full names of the encoder's Linear layers, a LLaVA's projector included ([] for a text model): lora.wrap puts
    no adapter there, so LoRA on a VLM adapts the language model only (peft freezes every base weight, the encoder's
    too)."""
    out = []
    for t in encoder(model):
        prefix = next(name for name, m in model.named_modules() if m is t)
        out += [f"{prefix}.{name}" for name, m in t.named_modules() if isinstance(m, torch.nn.Linear)]
    return out


def freeze_tower(model, train_tower: bool):
    """vision.train_tower=false (the default): the encoder (a LLaVA's projector too) takes no gradient and no
    optimizer state."""
    if not train_tower:
        for m in encoder(model):
            m.requires_grad_(False)


def uses_mrope(model, images: dict | None) -> bool:
    """Qwen2-VL's 3-D positions for a batch with pictures, unless the model was trained on text positions
    (config `text_positions`: the tiny VLM of tools/make_tiny_vlm.py)."""
    if not images:
        return False
    cfg = base_model(model).config
    if not family_of_config(cfg).mrope:
        return False
    rope = getattr(getattr(cfg, "text_config", cfg), "rope_parameters", None) or {}
    return "mrope_section" in rope and not getattr(cfg, "text_positions", False)


def positions(model, input_ids: Tensor, attention_mask: Tensor, images: dict | None,
              prompt_len: int | None = None, start: Tensor | None = None) -> Tensor:
    """Position ids of a batch: (B, T) text positions (models.position_ids), or for a Qwen2-VL reading pictures
    (uses_mrope) its M-RoPE positions (3, B, T): text tokens count on (the three rows equal), a picture's image
    tokens take (s, s + row, s + column) over its merged patch grid and move the count on by the grid's longer side,
    each of a row's pictures in turn (the pads `slots` names). Left padding takes 0. A decode step's position is then one
    past the row's largest (engines/builtin.py), the three rows equal again. start (B,): where each row's count
    begins (a chunk fed after a row's earlier tokens, engines/multiturn.py)."""
    text = (attention_mask.cumsum(-1) - 1).clamp(min=0)                                  # (B, T)
    if start is not None:
        text = text + start[:, None]
    if not uses_mrope(model, images):
        return text
    merge = base_model(model).config.vision_config.spatial_merge_size
    where = slots(model, input_ids, images, prompt_len)                                  # (B, T)
    # the k-th image pad of a row shows its pictures in turn, each taking t * H * W pads (H, W: the merged grid)
    index = images["image_index"].to(where.device)
    index = index[:, None] if index.dim() == 1 else index                                # (B, K), -1 = none
    index = index if index.shape[1] else index.new_full((len(index), 1), -1)
    grid = images["image_grid_thw"].to(where.device)                                     # (U, 3)
    grid = torch.cat([grid, grid.new_zeros(1, 3)])        # row U: a no-picture of 0 pads, so -1 needs no branch
    t, H, W = grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge                        # (U + 1,) each
    pic = torch.where(index >= 0, index, len(grid) - 1)                                  # (B, K)
    n, width = (t * H * W)[pic], W.clamp(min=1)[pic]                                     # (B, K) pads, grid width
    # the text after a picture moves on by its grid's longer side, not by its pad count
    moved = (torch.maximum(H, W) - t * H * W)[pic]                                       # (B, K)
    ends = n.cumsum(-1)                                                                  # (B, K)
    count = where.sum(-1)                                                                # (B,)
    if bool((count < ends[:, -1]).any()):   # the one host sync: a row's pads cannot hold its pictures
        b = int((count < ends[:, -1]).nonzero()[0])
        k = int((ends[b] > count[b]).nonzero()[0])
        raise ValueError(f"row {b} has fewer image tokens than its pictures' {int(n[b, k])}")
    rank = where.cumsum(-1) - 1                                                          # (B, T) pad's rank in row
    k = torch.searchsorted(ends, rank.clamp(min=0), right=True)                          # (B, T) its picture
    shows = where & (k < index.shape[1])                                                 # pads past the last: text
    k = k.clamp(max=index.shape[1] - 1)
    within = rank - (ends - n).gather(1, k)                                              # (B, T) pad's rank in picture
    last = shows & (within == n.gather(1, k) - 1)                                        # (B, T) a picture's last pad
    step = torch.where(last, moved.gather(1, k), 0)                                      # (B, T)
    text = text + step.cumsum(-1) - step                                                 # moved by the pictures before
    start_col = torch.zeros(index.shape[0], index.shape[1] + 1, dtype=torch.long, device=text.device)   # (B, K + 1)
    cols = torch.arange(text.shape[1], device=text.device).expand_as(text)               # (B, T)
    start_col.scatter_(1, torch.where(shows & (within == 0), k, index.shape[1]), cols)  # each picture's first pad
    s = text.gather(1, start_col[:, :-1].gather(1, k))                                   # (B, T) its picture's start
    w = width.gather(1, k)                                                               # (B, T)
    out = text[None].repeat(3, 1, 1)                                                     # (3, B, T)
    out[0] = torch.where(shows, s, text)
    out[1] = torch.where(shows, s + within // w, text)
    out[2] = torch.where(shows, s + within % w, text)
    return out


def embed(model, input_ids: Tensor, images: dict, prompt_len: int | None = None) -> Tensor:
    """(B, T) ids -> (B, T, H) input embeddings: the image pads that show pictures (`slots`: image_mask, else those of
    the first prompt_len columns) replaced by the features of the row's pictures. The encoder runs once per picture
    of the table."""
    return place(model, base_model(model).get_input_embeddings()(input_ids), input_ids, images, prompt_len)


def model_inputs(model, input_ids: Tensor, images: dict, prompt_len: int | None = None) -> dict:
    """The keywords that give a training forward its pictures: `inputs_embeds` from `embed`, or for an FSDP2-sharded
    policy (distributed.shard) the ids themselves, with the pictures placed by a one-shot hook on the embedding
    layer. Why: the embeddings (and a tied head) live in FSDP's root unit, which is gathered, and whose gradient is
    reduce-scattered, around the model's forward; an embedding computed before it would meet sharded weights, and
    its gradient would arrive after the root's reduce-scatter fired on `inputs_embeds`' gradient."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        return {"inputs_embeds": embed(model, input_ids, images, prompt_len)}
    layer = base_model(model).get_input_embeddings()
    if getattr(model, "_vision_hook", None) is not None:   # a forward that raised before its embedding ran
        model._vision_hook.remove()

    def hook(module, args, output):                        # (B, T, H) token embeddings -> with the pictures
        model._vision_hook.remove()
        model._vision_hook = None
        return place(model, output, input_ids, images, prompt_len)
    model._vision_hook = layer.register_forward_hook(hook)
    return {"input_ids": input_ids}


def place(model, embeds: Tensor, input_ids: Tensor, images: dict, prompt_len: int | None = None) -> Tensor:
    """(B, T, H) token embeddings of (B, T) ids -> the same with the image pads that show pictures (`slots`) replaced
    by the features of the row's pictures, in order (the encoder once per picture of the table)."""
    where = slots(model, input_ids, images, prompt_len)                                  # (B, T)
    per_row = row_pictures(images)
    model = base_model(model)
    feats = []
    if len(images["pixel_values"]):   # else no picture in the batch
        params = [p for m in encoder(model) for p in m.parameters()]
        # a frozen encoder: no graph
        with torch.set_grad_enabled(torch.is_grad_enabled() and any(p.requires_grad for p in params)):
            feats = family(model).features(model, images, params[0])                   # U x (n_u, H)
    want = torch.tensor([sum(len(feats[u]) for u in row) for row in per_row], device=where.device, dtype=torch.long)
    if not torch.equal(where.sum(-1), want):                                              # (B,) each
        raise ValueError(f"image tokens per row {where.sum(-1).tolist()} but image features for "
                         f"{want.tolist()}")
    if not feats:
        return embeds
    rows = torch.cat([feats[u] for row in per_row for u in row]).to(embeds.dtype)       # (slots, H)
    return embeds.masked_scatter(where[..., None], rows)
