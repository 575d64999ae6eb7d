"""Qwen-Image's transformer in its original layout: the released weights are diffusers-named
(ComfyUI's model holds the same names), so the file is the folder's weights in one file. Qwen-Image
2.1's fuses each block's SwiGLU gate and up projections into `img_mlp.gate_up` (gate rows first),
which diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers splits."""
from __future__ import annotations

from .renaming import State, fused


def transformer(state: State, config: dict) -> State:
    return dict(state)


def transformer_21(state: State, config: dict) -> State:
    return fused(state, (".img_mlp.gate_layer.", ".img_mlp.proj."), ".img_mlp.gate_up.")


WRITERS = {"QwenImageTransformer2DModel": transformer, "QwenImage21Transformer2DModel": transformer_21}
