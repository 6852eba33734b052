"""A tiny vision model made here, with random weights: Idefics3-shaped (SmolVLM's
family: a SigLIP-like vision tower, a pixel-shuffle connector, a small Llama), SmolLM2's
tokenizer with Idefics3's image tokens added, and a chat template that puts one
``<image>`` where an image part is. vLLM serves it like any Idefics3; its answers are
noise, its plumbing is real: vLLM's processor widens each ``<image>`` into the image's
``IMAGE_TOKENS`` prompt tokens and computes the features from the pixels.

(A LLaVA-shaped one would be smaller still, but vLLM 0.32's llava module imports
torchvision -- through pixtral -- and the CPU venv has none: the PyPI torchvision's
``_C`` does not load beside the CPU torch.)
"""

from __future__ import annotations

from pathlib import Path

IMAGE = "<image>"
TOKENS = ["<fake_token_around_image>", IMAGE, "<end_of_utterance>", "<global-img>"]
IMAGE_SIZE = 56
PATCH = 14
SCALE = 2  # the connector's pixel shuffle
SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2  # <image> tokens per image
# one image unsplit: <fake_token_around_image><global-img><image>*SEQ_LEN<fake_token_around_image>
IMAGE_TOKENS = SEQ_LEN + 3

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE + "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(text_model_dir: Path, out: Path, seed: int = 0) -> Path:
    """The model's directory (config, weights, tokenizer, processor, template)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": TOKENS})
    tokenizer.chat_template = TEMPLATE
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,  # head_dim 64: vLLM's CPU attention takes no 16
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        scale_factor=SCALE,
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        tie_word_embeddings=False,
    )
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(out)
    images = Idefics3ImageProcessor(
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=SEQ_LEN, chat_template=TEMPLATE
    )
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
