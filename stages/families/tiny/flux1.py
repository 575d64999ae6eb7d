"""A tiny Flux.1 built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch flux1`.

Transformer: 1 double + 1 single block, 2 heads of 16, joint and pooled dim 32, rope axes
(4, 4, 8); CLIP: the tiny byte-level one the SD models use too (clip.py, pooled dim 32); T5: an
inline T5Config with d_model 32 and a Unigram tokenizer trained on the bundled captions; VAE: 16
latent channels, 8x downsampling, Flux.1's shift and scale (Z-Image's too). Random weights from a fixed seed; saved as a FluxPipeline
folder that `FluxPipeline.from_pretrained` loads offline (or, `--arch flux1-kontext`, the same weights as a
FluxKontextPipeline folder: Kontext's transformer is Flux.1 dev's, it reads a reference image's tokens too).

The tokenizers library's Unigram trainer differs between runs in the last bits of its scores and
in the order of equal ones (its hash maps are seeded per process), so the scores are rounded and the
pieces sorted; ASCII characters the captions lack are added below the lowest score, so any ASCII
prompt tokenizes without <unk>.
"""
from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import torch

from .clip import clip_text_encoder, write_tokenizer

SEED = 0
CAPTIONS = Path(__file__).resolve().parents[2] / "assets" / "demo_images"
T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5
DEV_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True)  # FLUX.1-dev's scheduler_config.json
SCHNELL_SCHEDULER = dict(shift=1.0, use_dynamic_shifting=False)


def unigram_vocab(captions: list[str], vocab_size: int = 300) -> list[tuple[str, float]]:
    """T5-style (piece, score) pairs: the specials first, then pieces by score."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([  # as T5Tokenizer splits words
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(T5_SPECIALS), unk_token="<unk>",
                                      show_progress=False)
    tokenizer.train_from_iterator(captions, trainer)
    trained = [(piece, round(score, 4)) for piece, score in json.loads(tokenizer.to_str())["model"]["vocab"]
               if piece not in T5_SPECIALS]
    pieces = sorted(trained, key=lambda p: (-p[1], p[0]))
    known, lowest = {p for p, _ in pieces}, min(score for _, score in pieces) - 1
    pieces += [(c, lowest) for c in string.ascii_letters + string.digits + string.punctuation if c not in known]
    return [(special, 0.0) for special in T5_SPECIALS] + pieces


def t5_tokenizer():
    from transformers import T5Tokenizer

    captions = [p.read_text().strip() for p in sorted(CAPTIONS.glob("*.txt"))]
    return T5Tokenizer(vocab=unigram_vocab(captions), extra_ids=0, model_max_length=512)


def _t5(vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(SEED)
    return T5EncoderModel(T5Config(  # T5 v1.1's gated-GELU, as Flux.1's T5-XXL
        vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    ))


def _transformer(guidance: bool):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(SEED)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance, axes_dims_rope=(4, 4, 8),
    )


def vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(SEED)
    return AutoencoderKL(  # four levels: 8x downsampling; no quant convs, Flux.1's shift and scale
        in_channels=3, out_channels=3, latent_channels=16, norm_num_groups=8, sample_size=64,
        block_out_channels=(8, 16, 32, 32), layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.1159, scaling_factor=0.3611,
    )


def build_tiny_flux1(out_dir: Path, guidance: bool = True, pipeline_class: str = "FluxPipeline") -> Path:
    """Write a tiny Flux.1 dev (guidance input) or schnell into out_dir, as a `pipeline_class` folder."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    out_dir = Path(out_dir)
    t5_tok = t5_tokenizer()
    pipe = getattr(diffusers, pipeline_class)(
        scheduler=FlowMatchEulerDiscreteScheduler(**(DEV_SCHEDULER if guidance else SCHNELL_SCHEDULER)),
        vae=vae(), text_encoder=clip_text_encoder(False), tokenizer=write_tokenizer(out_dir / ".tokenizer-src"),
        text_encoder_2=_t5(len(t5_tok)), tokenizer_2=t5_tok, transformer=_transformer(guidance),
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(out_dir / ".tokenizer-src")
    return out_dir
