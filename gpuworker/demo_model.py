"""Write a tiny Llama-style demo checkpoint with random weights: its generated text is noise.

    python -m gpuworker.demo_model PATH [--hidden 64 --layers 2 --heads 4 --kv-heads 2 ...]

The directory is a normal Hugging Face checkpoint (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with a Llama-3-style chat template)
that loads with our loader and with transformers, so the whole platform can run without any
download. `--vision` writes a tiny Qwen2.5-VL instead (demo-vision), its chat template placing
each image. The tokenizer is byte-level: token i < 256 is byte i, followed by Llama-3's special tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|start_header_id|>", "<|end_header_id|>", EOT_TOKEN)
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)
BOS_TOKEN_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(BOS_TOKEN)
EOS_TOKEN_IDS = [NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(token) for token in (EOS_TOKEN, EOT_TOKEN)]
NOISE_NOTICE = "This demo model has random weights: its output is random noise, not language."

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


# The demo vision model's image tokens: reserved special tokens of the byte-level tokenizer, written
# by its chat template for each image part as Qwen2.5-VL writes <|vision_start|><|image_pad|><|vision_end|>.
VISION_VOCAB_SIZE = 384
IMAGE_TOKEN_ID, VISION_START_TOKEN_ID, VISION_END_TOKEN_ID, VIDEO_TOKEN_ID = 380, 381, 382, 379


def reserved_token(token_id: int) -> str:
    """The tokenizer's name of a token id past its named special tokens."""
    return f"<|reserved_special_token_{token_id - MIN_VOCAB_SIZE}|>"


def vision_chat_template(image_placeholder: list[int]) -> str:
    """CHAT_TEMPLATE reading content parts too: an {"type": "image"} part becomes the tokens of
    image_placeholder, and {"type": "text"} its text."""
    placeholder = "".join(reserved_token(token_id) for token_id in image_placeholder)
    return (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] | trim }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' %}{{- '" + placeholder + "' }}{%- else %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    )


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer`: 256 byte tokens (no merges), the special tokens, then reserved
    special tokens up to `vocab_size` so every id the model can emit decodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    byte_to_char = bytes_to_unicode()
    tokenizer = Tokenizer(
        models.BPE(vocab={byte_to_char[b]: b for b in range(NUM_BYTE_TOKENS)}, merges=[], fuse_unk=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(vocab_size - MIN_VOCAB_SIZE)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *reserved)])
    # Like Llama 3, plain encoding starts with BOS (the chat template writes its own).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)]
    )
    return tokenizer


def write_tokenizer(
    path: str | Path, vocab_size: int, model_max_length: int, chat_template: str = CHAT_TEMPLATE
) -> None:
    """Write tokenizer.json and a tokenizer_config.json that carries the chat template."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_demo_model(
    path: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 320,
    max_position_embeddings: int = 2048,
    rope_theta: float = 500000.0,
    seed: int = 0,
) -> Path:
    """Write the checkpoint into `path` (created if needed) and return it."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_IDS,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(directory))
    GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_IDS).save_pretrained(str(directory))
    write_tokenizer(directory, vocab, max_position_embeddings)
    return directory


def write_demo_vision_model(path: str | Path, *, max_position_embeddings: int = 2048, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL checkpoint (random weights, its image processor's resolution between 4 and
    256 image tokens) with the byte-level tokenizer and vision_chat_template, into `path`."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    text = {
        "vocab_size": VISION_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_IDS[1],
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_IDS,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).float().save_pretrained(str(directory))
    GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_IDS).save_pretrained(str(directory))
    processor = Qwen2VLImageProcessor(
        min_pixels=4 * 28 * 28, max_pixels=256 * 28 * 28, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    processor.save_pretrained(str(directory))
    template = vision_chat_template([VISION_START_TOKEN_ID, IMAGE_TOKEN_ID, VISION_END_TOKEN_ID])
    write_tokenizer(directory, VISION_VOCAB_SIZE, max_position_embeddings, template)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuworker.demo_model", description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write the checkpoint into")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP size (default 4 * hidden)")
    parser.add_argument("--vocab", type=int, default=320, help=f"vocabulary size (at least {MIN_VOCAB_SIZE})")
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vision", action="store_true", help="a tiny Qwen2.5-VL vision model instead (the size options are ignored)"
    )
    args = parser.parse_args(argv)
    if args.vision:
        directory = write_demo_vision_model(
            args.path, max_position_embeddings=args.max_position_embeddings, seed=args.seed
        )
        print(f"Wrote a tiny Qwen2.5-VL demo vision model to {directory}")
        print(NOISE_NOTICE)
        return 0
    for name in ("hidden", "layers", "heads", "kv_heads", "max_position_embeddings"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if args.vocab < MIN_VOCAB_SIZE:
        parser.error(f"--vocab must be at least {MIN_VOCAB_SIZE}")
    directory = write_demo_model(
        args.path,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
    )
    print(f"Wrote a tiny Llama-style demo model to {directory}")
    print(NOISE_NOTICE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
