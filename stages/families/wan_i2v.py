"""Wan image-to-video (WanImageToVideoPipeline): Wan 2.1 I2V, Wan 2.2 I2V A14B and Wan 2.2 TI2V-5B, a
clip conditioned on its first frame.

As WanImageToVideoPipeline.prepare_latents builds the condition: the image followed by zero frames
to the clip's length through the VAE (the posterior's mean), normalised per channel, behind a
first-frame mask of `vae_scale_factor_temporal` channels (ones on the first latent frame, zeros
after), concatenated on channels after the noisy latents; the transformer also reads the image's
CLIP-vision embedding (the penultimate hidden state, the pipeline's encode_image) as
encoder_hidden_states_image. The conditioning image's record (ImageCondition, padded) holds the
padded clip's posterior (normalised when read) and that embedding; everything else is Wan's. Wan 2.2
I2V A14B has two experts chosen as Wan's A14B's are (train.denoiser) and no image encoder: its
condition is the mask and the latents alone. Wan 2.2 TI2V-5B conditioned on an image (a folder whose
model_index.json names WanImageToVideoPipeline with expand_timesteps): the image alone through the
VAE replaces the first latent frame, whose tokens take timestep 0; the loss scores the frames after it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import IMAGE_EMBEDS, MODEL_INDEX, REFERENCE_LATENTS, Conditioning, ImageCondition
from .folders import load_component
from .video import after_first_frame, with_first_frame_condition
from .wan import TIMESTEP_SCALE, WAN, Wan, WanVariant, ftfy_version

if TYPE_CHECKING:
    import torch

    from .objectives import Objective


@dataclass(frozen=True)
class WanI2VVariant(WanVariant):
    reads_image_embedding: bool = False  # Wan 2.1's transformer also reads the image's CLIP-vision embedding


I2V_A14B = WanI2VVariant("2.2-i2v-a14b", "wan2.2-i2v-a14b", 40, 3.5)  # its boundary_ratio: the model's (for_model)
I2V_VARIANTS = (  # A14B last: told apart by its transformer_2
    WanI2VVariant("2.2-ti2v-5b-i2v", "wan2.2-5b-i2v", 50, 5.0, markers=((MODEL_INDEX, "expand_timesteps", True),),
                  per_token_timesteps=True, render_frames=121),
    WanI2VVariant("2.1-i2v", "wan2.1-i2v", 50, 5.0, reads_image_embedding=True),
    I2V_A14B,
)


class ClipVisionEmbedder:
    """WanImageToVideoPipeline.encode_image on placed pixels: the image processor on the image as
    8-bit RGB (what the pipeline is handed), the CLIP vision model's penultimate hidden state."""

    processor_component = "image_processor"

    def __init__(self, model_path: Path, component: str, device: str):
        self.processor = load_component(model_path, self.processor_component)
        self.encoder = load_component(model_path, component).eval().requires_grad_(False).to(device)
        self.device = device

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        import torch
        from PIL import Image

        images = [Image.fromarray(((p + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy())
                  for p in pixels]
        inputs = self.processor(images=images, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            return self.states(inputs).float().cpu()

    def states(self, inputs: Any) -> torch.Tensor:
        return self.encoder(**inputs, output_hidden_states=True).hidden_states[-2]


def first_frame_condition(reference: torch.Tensor, mask_channels: int) -> torch.Tensor:
    """The transformer's conditioning channels (B, mask_channels + C, F', h, w) from the conditioning
    image's normalised latents (B, C, F', h, w): the first-frame mask, then the latents."""
    import torch

    mask = torch.zeros(reference.shape[0], mask_channels, *reference.shape[2:], dtype=reference.dtype)
    mask[:, :, 0] = 1
    return torch.cat([mask.to(reference.device), reference], dim=1)


@dataclass(frozen=True)
class WanI2V(Wan):
    variants: tuple[WanI2VVariant, ...] = I2V_VARIANTS
    max_references: int = 1
    image_condition: ImageCondition | None = ImageCondition(padded=True, embedder=ClipVisionEmbedder)
    renders_without_references: bool = False

    def for_model(self, model_path: Path) -> WanI2V:
        """Bound to the variant, whose condition follows from it: TI2V-5B's is the image alone (its
        first latent frame), the others' the padded clip; only Wan 2.1's reads an image embedding."""
        bound = super().for_model(model_path)
        variant = bound.variant if not bound.denoiser_choices else \
            replace(I2V_A14B, boundary_ratio=bound.variant.boundary_ratio)  # Wan's rule found two experts
        embedder = ClipVisionEmbedder if variant.reads_image_embedding else None
        return replace(bound, variant=variant, image_condition=ImageCondition(not variant.per_token_timesteps, embedder),
                       components=replace(bound.components, image=bound.components.image if embedder else ()))

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As WanImageToVideoPipeline calls its transformer: the noisy latents with the first-frame
        mask and the condition on channels (TI2V-5B: the condition as the first latent frame, its
        tokens at timestep 0), 1000 sigma, the padded text, the image embedding (Wan 2.1's)."""
        import torch

        reference = conditioning[REFERENCE_LATENTS][:, 0].to(noisy.device, noisy.dtype)
        t = (timesteps.float() * TIMESTEP_SCALE).to(noisy.device)
        if self.bound.per_token_timesteps:
            height, width = noisy.shape[3:]
            hidden, t = with_first_frame_condition(noisy, reference, t,
                                                   (height // self.latent_patch) * (width // self.latent_patch))
        else:
            mask_channels = transformer.config.in_channels - noisy.shape[1] - reference.shape[1]
            hidden = torch.cat([noisy, first_frame_condition(reference, mask_channels)], dim=1)
        text = conditioning["encoder_hidden_states"].to(device=noisy.device, dtype=dtype)
        image = conditioning[IMAGE_EMBEDS][:, 0].to(device=noisy.device, dtype=dtype) \
            if IMAGE_EMBEDS in conditioning else None  # Wan 2.1's; the others' transformers read none
        return transformer(hidden_states=hidden.to(dtype), timestep=t, encoder_hidden_states=text,
                           encoder_hidden_states_image=image, return_dict=False)[0].float()

    def loss_region(self, pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TI2V-5B's first latent frame is the condition, not denoised: the loss scores the others."""
        return after_first_frame(pred, target) if self.bound.per_token_timesteps else (pred, target)

    def prepare_pipeline(self, pipe: Any, sampler: str, objective: Objective) -> None:
        super().prepare_pipeline(pipe, sampler, objective)
        if ftfy_version() is None:  # the I2V pipeline's prompt_clean calls ftfy unchecked; WanPipeline's,
            from diffusers import WanPipeline  # the same code otherwise, checks that it is installed

            pipe._get_t5_prompt_embeds = WanPipeline._get_t5_prompt_embeds.__get__(pipe)

    def build_tiny_variant(self, out_dir: Path, variant: WanVariant) -> Path:
        from .tiny.wan_i2v import build_tiny_ti2v_i2v, build_tiny_wan_i2v

        if variant.per_token_timesteps:
            return build_tiny_ti2v_i2v(out_dir)
        return build_tiny_wan_i2v(out_dir, experts=variant is I2V_A14B)


WAN_I2V = WanI2V(
    name="wan-i2v", label="Wan I2V", pipeline_class="WanImageToVideoPipeline",
    components=replace(WAN.components, image=("image_encoder", "image_processor")), kohya=WAN.kohya,
    latent_patch=WAN.latent_patch, text_encoder=WAN.text_encoder, original_formats=WAN.original_formats,
    sampler=WAN.sampler, block_lists=WAN.block_lists, denoiser_names=WAN.denoiser_names,
    size_free_converters=WAN.size_free_converters,
)
