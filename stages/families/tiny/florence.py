"""A tiny Florence-2 captioner built offline, byte-for-byte reproducible, for the caption stage's
tests and demo (its captions are nonsense; the plumbing is real).

The folder is what a converted Florence-2 checkpoint (florence-community/Florence-2-*) holds:
a Florence2ForConditionalGeneration (DaViT vision tower with the real four stages of strides
4, 2, 2, 2, a BART encoder-decoder) with random weights from SEED, the generation config those
checkpoints ship (three beams, no repeated trigrams, forced BOS/EOS), and a Florence2Processor:
CLIP's image processor (its PIL backend: no torchvision needed) resizing to a square without
cropping, BART's tokenizer (RoBERTa's byte-level BPE) over the vocabulary tiny/qwen.py trains on the
bundled captions, with BART's specials at BART's ids and Florence-2's `<image>` token, and the
post-processor configuration whose keys post_process_generation requires.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .qwen import CAPTIONS, ENDOFTEXT, bpe_vocab_and_merges, seeded

IMAGE_SIDE = 64  # the DaViT strides make 64 px two by two patches: 4 spatial + 1 temporal image token
IMAGE_TOKEN = "<image>"
INIT_STD = 0.5  # far above the real 0.02, so that random weights caption different images differently
EOS_SCALE = 3.0  # a louder EOS embedding (tied to the LM head): some captions end early, as real ones do
BART_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3, as in BART; <mask> follows the BPE tokens
# The parse tasks Florence2PostProcessor checks a task against (the real checkpoints' keys).
POST_PROCESSOR_CONFIG = {
    "ocr": {"AREA_THRESHOLD": 0.0},
    "phrase_grounding": {"banned_grounding_tokens": ["the image"]},
    "pure_text": {},
    "description_with_bboxes": {},
    "description_with_polygons": {},
    "polygons": {},
    "bboxes": {},
    "description_with_bboxes_or_polygons": {},
}
TOKEN_IDS = dict(bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
GENERATION = dict(TOKEN_IDS, forced_bos_token_id=0, early_stopping=True, no_repeat_ngram_size=3, num_beams=3)


def _tokenizer():
    from transformers import BartTokenizer

    captions = [p.read_text().strip() for p in sorted(CAPTIONS.glob("*.txt"))]
    learned, merges = bpe_vocab_and_merges(captions)
    tokens = [*BART_SPECIALS, *(t for t in sorted(learned, key=learned.get) if t != ENDOFTEXT), "<mask>"]
    return BartTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, model_max_length=1024,
                         extra_special_tokens={"image_token": IMAGE_TOKEN})


def _processor():
    from transformers import CLIPImageProcessorPil, Florence2Processor

    images = CLIPImageProcessorPil(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}, do_center_crop=False,
                                   image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    images.image_seq_length = (IMAGE_SIDE // 32) ** 2 + 1
    return Florence2Processor(image_processor=images, tokenizer=_tokenizer(),
                              post_processor_config=POST_PROCESSOR_CONFIG)


def _config(tokenizer):
    from transformers import Florence2Config

    text = dict(model_type="bart", vocab_size=len(tokenizer), d_model=16, encoder_layers=1, decoder_layers=1,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                max_position_embeddings=256, init_std=INIT_STD, **TOKEN_IDS)
    vision = dict(depths=[1, 1, 1, 1], embed_dim=[8, 8, 16, 16], num_heads=[1, 1, 2, 2], num_groups=[1, 1, 2, 2],
                  window_size=2, projection_dim=16, drop_path_rate=0.0, initializer_range=INIT_STD)
    return Florence2Config(text_config=text, vision_config=vision, image_token_id=tokenizer.image_token_id,
                           initializer_range=INIT_STD)


def build_tiny_florence(out_dir: Path) -> Path:
    from transformers import Florence2ForConditionalGeneration, GenerationConfig

    out_dir = Path(out_dir)
    processor = _processor()
    model = seeded(Florence2ForConditionalGeneration, _config(processor.tokenizer))
    with torch.no_grad():
        model.get_input_embeddings().weight[processor.tokenizer.eos_token_id] *= EOS_SCALE
    model.generation_config = GenerationConfig(**GENERATION)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir
