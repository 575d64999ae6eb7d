"""A tiny HiDream-I1 built offline, byte-for-byte reproducible: `lorapipe tiny-model DIR --arch
hidream-i1` (Full), `hidream-i1-dev` or `hidream-i1-fast` (the same weights, each with its variant's
scheduler, as the published folders differ).

Transformer: 2 double-stream and 2 single-stream blocks of 2 heads of 16, rope axes (8, 4, 4), a
mixture-of-experts feed-forward of 4 routed experts (2 active per token) and a shared one, as the
full model's, reading Llama layers 0, 1, 2, 2 (the full model repeats its last layer too); text
encoders: two tiny byte-level CLIPs with projections (pooled 32 + 16) and 248 positions (HiDream's
long CLIPs: the pipeline reads up to 218 tokens), Flux.1's tiny T5, and a 3-layer, 16-dim Llama
around a byte-level BPE tokenizer trained on the bundled captions with Llama 3.1's specials (its
bos added by the post-processor, `<|eot_id|>` its eos, as Llama-3.1-Instruct's); VAE: Flux.1's
tiny one (shift and scale).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .clip import clip_text_encoder, write_tokenizer
from .flux1 import _t5, t5_tokenizer, vae
from .qwen import CAPTIONS, bpe_vocab_and_merges, seeded

BOS, END, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
# Llama 3's split: Qwen2's, but digits in runs of up to three
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA_DIM, LLAMA_LAYERS = 16, 3
T5_DIM = 32  # Flux.1's tiny T5's d_model
CLIP_POSITIONS = 248
POOLED_DIMS = (32, 16)  # the two CLIPs' projections
SCHEDULERS = {  # each variant's, as its published scheduler_config.json
    "full": ("UniPCMultistepScheduler", dict(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")),
    "dev": ("FlowMatchEulerDiscreteScheduler", dict(shift=6.0, use_dynamic_shifting=False)),
    "fast": ("FlowMatchEulerDiscreteScheduler", dict(shift=3.0, use_dynamic_shifting=False)),
}


def llama_tokenizer():
    """A Llama 3 style fast tokenizer: byte-level BPE, bos added to every text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = bpe_vocab_and_merges([p.read_text().strip() for p in sorted(CAPTIONS.glob("*.txt"))])
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, END, EOT])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                             special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOT, model_max_length=131072)


def _llama(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    bos, eos = tokenizer.convert_tokens_to_ids([BOS, EOT])
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=LLAMA_DIM, intermediate_size=32, num_hidden_layers=LLAMA_LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=1024,
        bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False,
    )).eval()


def _transformer():
    from diffusers import HiDreamImageTransformer2DModel

    return HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        caption_channels=[T5_DIM, LLAMA_DIM], text_emb_dim=sum(POOLED_DIMS), num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(32, 32), llama_layers=[0, 1, 2, 2],
    )


def build_tiny_hidream(out_dir: Path, variant: str) -> Path:
    """Write a tiny HiDream-I1 of `variant` (full, dev or fast) into out_dir."""
    import diffusers
    from diffusers import HiDreamImagePipeline

    out_dir = Path(out_dir)
    scheduler_class, scheduler_config = SCHEDULERS[variant]
    tokenizer_4 = llama_tokenizer()
    clip_tokenizer = write_tokenizer(out_dir / ".tokenizer-src")
    pipe = HiDreamImagePipeline(
        scheduler=getattr(diffusers, scheduler_class)(**scheduler_config), vae=vae(),
        text_encoder=clip_text_encoder(True, CLIP_POSITIONS, POOLED_DIMS[0]), tokenizer=clip_tokenizer,
        text_encoder_2=clip_text_encoder(True, CLIP_POSITIONS, POOLED_DIMS[1]), tokenizer_2=clip_tokenizer,
        text_encoder_3=_t5(len(t5_tokenizer())), tokenizer_3=t5_tokenizer(),
        text_encoder_4=seeded(_llama, tokenizer_4), tokenizer_4=tokenizer_4, transformer=seeded(_transformer),
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(out_dir / ".tokenizer-src")
    return out_dir
