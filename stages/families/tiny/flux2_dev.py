"""A tiny Flux.2-dev built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch flux2-dev`.

Klein's tiny transformer with the guidance input and the shared tiny Flux.2 VAE; text encoder: a
Mistral3ForConditionalGeneration with a 16-dim, 31-layer Mistral language model (layers 10, 20 and
30 are read, none of them the final norm's output, as at full size) and a 1-layer Pixtral vision
tower; its processor wraps the shared tiny BPE tokenizer, given Mistral's specials, its `<s>` bos
and a chat template that renders what Mistral Small 3's renders for a system message and a user
message of text parts. The processor is a LlavaProcessor around Pixtral's PIL image processor in
place of the PixtralProcessor, which transformers cannot build without torchvision (text-to-image
reads only its tokenizer and chat template).
"""
from __future__ import annotations

from pathlib import Path

from .flux2 import tiny_flux2_vae, transformer
from .qwen import TEXT_DIM, qwen_tokenizer, seeded

TEXT_LAYERS = 31
BOS, IMAGE = "<s>", "[IMG]"
MISTRAL_SPECIALS = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", IMAGE, "[IMG_BREAK]", "[IMG_END]")
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set text = message['content'] if message['content'] is string"
    " else message['content'] | map(attribute='text') | join('') %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{{- '[INST]' + text + '[/INST]' }}{%- endif %}"
    "{%- endfor %}"
)


def mistral_tokenizer():
    """The shared tiny BPE tokenizer with Mistral's specials and bos."""
    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"bos_token": BOS, "additional_special_tokens": list(MISTRAL_SPECIALS)},
                                 replace_extra_special_tokens=False)
    return tokenizer


def mistral3_config(tokenizer):
    """A Mistral3 config of a 16-dim, 31-layer language model and a 1-layer Pixtral vision tower."""
    from transformers import Mistral3Config

    return Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": TEXT_DIM, "intermediate_size": 32,
                     "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 2,
                     "head_dim": 8, "vocab_size": len(tokenizer), "max_position_embeddings": 1024},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 64, "patch_size": 16},
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE), tie_word_embeddings=False,
    )


def _text_encoder(tokenizer):
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration(mistral3_config(tokenizer)).eval()


def _processor(tokenizer):
    from transformers import LlavaProcessor
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    return LlavaProcessor(image_processor=PixtralImageProcessorPil(patch_size=16), tokenizer=tokenizer,
                          patch_size=16, chat_template=CHAT_TEMPLATE, image_token=IMAGE)


def build_tiny_flux2_dev(out_dir: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    tokenizer = mistral_tokenizer()
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True), vae=seeded(tiny_flux2_vae),
        text_encoder=seeded(_text_encoder, tokenizer), tokenizer=_processor(tokenizer),
        transformer=seeded(transformer, guidance=True),
    )
    pipe.save_pretrained(Path(out_dir), safe_serialization=True)
    return Path(out_dir)
