"""LTX-2.5: LTX-2's transformer, text side and VAE, which diffusers ships only as a modular pipeline
(LTX25ModularPipeline, read from its modular_model_index.json) that renders with a diffusion decoder.

Training is LTX-2's (ltx2.py), as LTX25AutoBlocks reuses LTX-2's blocks for it: the text records are
LTX2TextConditioningStep's (Gemma, then the connectors), the latents the convolutional VAE's posterior
normalised as the decode block inverts it, the objective's shift LTX2SetTimestepsStep's, and predict
the denoise block's modality-isolation pass; each is tested against its block on the tiny model.
LTX-2.5 checkpoints carry LTX-2.3's transformer (gated attention, the text cross-attention
modulated by sigma, the captions projected by the connectors), which predict calls as the block does.

Rendering: the modular pipeline (modular.py) without its prompt enhancer (a second Gemma no caption
needs) and its duration head (evaluate gives the frame count), decoding with the diffusion decoder, a
component only rendering reads (`Components.render`: in evaluate's key, in no other stage's).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .ltx2 import LTX2, LTX2Family
from .video import VideoVariant

VARIANTS = (VideoVariant("2.5", "ltx2.5", 30, 3.0, max_sequence_length=1024, render_frames=121),)  # the blocks' defaults


@dataclass(frozen=True)
class LTX25Family(LTX2Family):
    variants: tuple[VideoVariant, ...] = VARIANTS

    def build_tiny_variant(self, out_dir: Path, variant: VideoVariant) -> Path:
        from .tiny.ltx2 import build_tiny_ltx25

        return build_tiny_ltx25(out_dir)


LTX25 = LTX25Family(
    name="ltx2.5", label="LTX-2.5", pipeline_class="LTX25ModularPipeline",
    components=replace(LTX2.components, render=("diffusion_decoder",)),
    kohya=LTX2.kohya, sequence_patch=LTX2.sequence_patch, text_encoder=LTX2.text_encoder,
    normalisation_of=LTX2.normalisation_of, clip_fps=LTX2.clip_fps, block_lists=LTX2.block_lists,
    render_left_out=("prompt_enhancer", "duration"),
)
