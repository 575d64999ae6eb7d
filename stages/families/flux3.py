"""FLUX.3's denoiser call, as its core denoise block (diffusers' Flux3CoreDenoiseStep) makes it: the
patchified latents (the flux2 family's layout) flattened to tokens, image ids (t, h, w, l) with h
and w scaled by the blocks' image RoPE scale, text ids (0, 0, 0, position) over every row of the
record (pad rows included: there is no text mask), and sigma as the timestep (not 1000 sigma).

The flux3 family is not registered yet: this module and flux3_text.py are its tested pieces
(docs/families.md, "Models diffusers ships only as modular pipelines").
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def predict(transformer: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, text: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """The transformer's prediction for (B, C, h, w) noisy latents at `sigmas` (B,) given (B, L, D)
    text records, in the latents' layout."""
    from diffusers.modular_pipelines.flux3.before_denoise import (Flux3PrepareLatentsStep, Flux3TextRoPEInputsStep,
                                                                  _prepare_image_ids)

    tokens = noisy.flatten(2).transpose(1, 2)
    image_ids = _prepare_image_ids(noisy.shape[2], noisy.shape[3], Flux3PrepareLatentsStep().image_rope_scale)
    out = transformer(hidden_states=tokens.to(dtype), encoder_hidden_states=text.to(noisy.device, dtype),
                      timestep=sigmas.to(dtype), img_ids=image_ids.to(noisy.device),
                      txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text).to(noisy.device), return_dict=False)[0]
    return out.transpose(1, 2).reshape(noisy.shape).float()
