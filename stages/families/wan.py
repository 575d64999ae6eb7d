"""Wan (2.1 T2V, 2.2 TI2V-5B): a flow-matching video transformer on the latents of a 3-D VAE,
conditioned on UMT5 prompt embeddings.

As WanPipeline does it: the caption cleaned by its `prompt_clean` (ftfy's fix_text when ftfy is
installed, HTML unescaped, whitespace collapsed: ftfy's version is a text setting), tokenized padded
to max_sequence_length (512, the pipeline's default) with a mask, UMT5's last hidden state at the
caption's own tokens: records are stored unpadded (L_i, 4096 at full size) and carry the length the
pipeline zero-pads them to (`pad_to`), because the transformer reads the padding, unmasked.

Latents: records (C, F', H', W') of the 3-D VAE's posterior, unscaled; clips of F = 4k + 1 frames
become k + 1 latent frames, an image (B, 3, H, W) is a one-frame clip. Normalised per channel with
the VAE config's latents_mean/latents_std (latents.ChannelMeanStd). The transformer patchifies 1x2x2
itself, so predict hands it the latents as they are, with the timestep 1000 sigma in float32 (its
time embedding runs in float32; bfloat16 rounds integers above 256).

Variants are data, told apart by model_index.json: Wan 2.1 T2V (16-channel VAE, 8x spatial) and
Wan 2.2 TI2V-5B (`expand_timesteps`: one timestep per latent token; a 48-channel VAE that patchifies
pixels 2x2 first, 16x spatial). The shift is the UniPC scheduler's `flow_shift`, static. Wan 2.2
A14B has two experts: WanPipeline denoises with `transformer` while t >= boundary_ratio x 1000 (high
noise) and with `transformer_2` below (low noise). Each is trained by a LoRA of its own, as the
ecosystem loads them (train.denoiser: high_noise or low_noise, or both in one run), on the noise
levels of its range only; both files use the names of `transformer` (diffusers loads the low-noise
one with `load_into_transformer_2=True`, ComfyUI into its low-noise model).

Exports: diffusers format, and Wan's original names (`blocks.N.self_attn.q`, `cross_attn.o`,
`ffn.0`, ... one to one with diffusers' modules, as diffusers' convert_wan_transformer_to_diffusers
maps them) spelt as ComfyUI reads them (`diffusion_model.*`) and as musubi-tuner writes them
(`lora_unet_*` with `.alpha`; diffusers' converter for that spelling reads a file only when it has
every Linear of every block: the attention_ff and all_linear presets). Hand-written: the original
module names (`ORIGINAL_*`), the converter's input.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pydantic import Field

from lorapipe.cache.errors import UserError
from lorapipe.stages.contract import Frozen

from .base import (FLOW_UNIPC, MODEL_INDEX, Components, Conditioning, Denoiser, ImageGeometry, Kohya, LatentGeometry,
                   TextOptions, TextRecord, pad_sequences)
from .flow import FlowVariant, presets_field
from .folders import component_config, load_component, model_index
from .latents import ChannelMeanStd, channel_mean_std_of
from .objectives import ObjectiveParams
from lorapipe.stages.lora_formats.original_names import (COMFYUI, KOHYA, KeySpelling, OriginalNames,
                                                         derive_original_names, kohya_name, weight_keys)
from .video import VideoFamily, VideoVariant
from .wan_vae_names import wan21_vae

if TYPE_CHECKING:
    import torch

BLOCK = r"blocks\.\d+\."
ATTENTION = (BLOCK + r"(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)",)
FEED_FORWARD = (BLOCK + r"ffn\.net\.(0\.proj|2)",)
ORIGINAL_BLOCK_MODULES = (*(f"{attention}.{p}" for attention in ("self_attn", "cross_attn") for p in "qkvo"),
                          "ffn.0", "ffn.2")
ORIGINAL_TOP_MODULES = ("text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2",
                        "time_projection.1", "head.head")
TIMESTEP_SCALE = 1000  # the pipeline's timesteps are 1000 sigma, as the transformer reads them
SPATIAL_DOWNSAMPLING = 8  # AutoencoderKLWan's default scale_factor_spatial (Wan 2.1's configs predate the key)
HIGH_NOISE, LOW_NOISE = "transformer", "transformer_2"  # A14B's experts; every other Wan has the first only




@dataclass(frozen=True)
class WanVariant(VideoVariant):
    per_token_timesteps: bool = False  # the pipeline's expand_timesteps: one timestep per latent token
    boundary_ratio: float | None = None  # A14B: sigma where the pipeline switches from transformer to transformer_2


A14B = WanVariant("2.2-t2v-a14b", "wan2.2-a14b", 40, 4.0)  # its boundary_ratio: the model's (for_model)
VARIANTS = (  # A14B last: told apart by its transformer_2 (for_model), not by markers
    WanVariant("2.2-ti2v-5b", "wan2.2-5b", 50, 5.0, markers=((MODEL_INDEX, "expand_timesteps", True),),
               per_token_timesteps=True, render_frames=121),
    WanVariant("2.1-t2v", "wan2.1", 50, 5.0),
    A14B,
)


class WanTextSettings(Frozen):
    max_sequence_length: int = Field(gt=0, description="UMT5 tokens: a record holds the caption's own, the"
                                     " transformer reads them zero-padded to this length, unmasked")
    ftfy: str | None = Field(description="the ftfy version WanPipeline's prompt_clean fixes captions with"
                             " (None: ftfy is not installed and captions are not fixed)")


def ftfy_version() -> str | None:
    """The installed ftfy's version when diffusers' Wan pipeline uses it, else None. Found as
    diffusers.utils.is_ftfy_available finds it, without importing diffusers: encode's key reads it,
    and a run served wholly from the cache imports no model code (flows/cached_run.py)."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    if find_spec("ftfy") is None:
        return None
    try:
        return version("ftfy")
    except PackageNotFoundError:
        return None


def check_ftfy(keyed: str | None) -> None:
    """Refuse to encode with another ftfy than the text settings (and so the records' keys) name."""
    if keyed != ftfy_version():
        raise UserError(f"encode: the text settings clean captions with ftfy {keyed or '(none)'}, this"
                        f" process has ftfy {ftfy_version() or '(none)'}: install the same ftfy where encode runs")


class WanTextEncoder:
    """WanPipeline._get_t5_prompt_embeds, batched: cleaned captions, UMT5's last hidden state at each
    caption's own tokens, and the length the pipeline pads them to."""

    def __init__(self, model_path: Path, settings: WanTextSettings, dtype: torch.dtype, device: str):
        check_ftfy(settings.ftfy)
        self.settings, self.dtype, self.device = settings, dtype, device
        self.tokenizer = load_component(model_path, "tokenizer")
        self.encoder = load_component(model_path, "text_encoder").eval().requires_grad_(False).to(device)

    def too_long(self, caption: str) -> bool:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        return len(self.tokenizer(prompt_clean(caption)).input_ids) > self.settings.max_sequence_length

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        length = self.settings.max_sequence_length
        tokens = self.tokenizer([prompt_clean(c) for c in captions], padding="max_length", max_length=length,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        with torch.inference_mode():
            hidden = self.encoder(tokens.input_ids.to(self.device), mask).last_hidden_state
        return [{"hidden_states": hidden[i, :int(n)].to(self.dtype).cpu(), "pad_to": torch.tensor(length)}
                for i, n in enumerate(mask.gt(0).sum(dim=1))]


@dataclass(frozen=True)
class Wan(VideoFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    normalisation_of: Callable[[Path, str], ChannelMeanStd] = channel_mean_std_of
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))

    def for_model(self, model_path: Path) -> Wan:
        index = model_index(model_path)
        if (index.get("transformer_2") or [None])[0] is None:
            return super().for_model(model_path)
        ratio = index.get("boundary_ratio")
        if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
            raise UserError(f"{model_path}/model_index.json: a Wan model with a transformer_2 needs the boundary_ratio"
                            f" (between 0 and 1) where the pipeline switches to it, not {ratio!r}")
        components = replace(self.components, other_denoisers=(LOW_NOISE,))
        choices = dict(zip(self.denoiser_names, (
            Denoiser(HIGH_NOISE, (ratio, math.inf)),
            Denoiser(LOW_NOISE, (0.0, ratio), (("load_into_transformer_2", True),)))))
        return replace(self, variant=replace(A14B, boundary_ratio=ratio), components=components,
                       denoiser_choices=choices)

    def temporal_compression(self, model_path: Path) -> int:
        return component_config(model_path, self.components.latent[0]).get("scale_factor_temporal", 4)

    def geometry(self, model_path: Path) -> LatentGeometry:
        config = component_config(model_path, self.components.latent[0])
        return LatentGeometry(config.get("scale_factor_spatial", SPATIAL_DOWNSAMPLING), self.latent_patch)

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> WanTextSettings:
        return WanTextSettings(max_sequence_length=self.text_length(options),
                               ftfy=ftfy_version())

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        embeds, _ = pad_sequences(texts, "hidden_states", int(texts[0]["pad_to"]))
        return {"encoder_hidden_states": embeds}

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As WanPipeline calls its transformer: the latents (B, C, F, H, W) as they are, 1000 sigma as
        the timestep (TI2V-5B: repeated for each of the F x H/2 x W/2 tokens), the padded text."""
        t = timesteps.float() * TIMESTEP_SCALE
        if self.bound.per_token_timesteps:
            frames, height, width = noisy.shape[2:]
            t = t[:, None].expand(-1, frames * (height // self.latent_patch) * (width // self.latent_patch))
        text = conditioning["encoder_hidden_states"].to(device=noisy.device, dtype=dtype)
        return transformer(hidden_states=noisy.to(dtype), timestep=t.to(noisy.device), encoder_hidden_states=text,
                           return_dict=False)[0].float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        return original_names(transformer.config.num_layers)

    def export_notes(self, transformer: torch.nn.Module, written: list[Path]) -> list[str]:
        """diffusers' converter for musubi's spelling reads every Linear of every block and nothing
        else (as musubi-tuner trains them); ComfyUI and musubi-tuner read any part of them."""
        from safetensors import safe_open

        def named(spelling: KeySpelling) -> Path | None:  # its name, or with a denoiser's after it (expert_file)
            return next((file for file in written if file.name.startswith(Path(spelling.file).stem)), None)

        kohya = named(KOHYA)
        if kohya is None:
            return []
        with safe_open(kohya, "pt") as f:
            trained = {key.removesuffix(".alpha") for key in f.keys() if key.endswith(".alpha")}
        every = {kohya_name(f"blocks.{i}.{module}") for i in range(transformer.config.num_layers)
                 for module in ORIGINAL_BLOCK_MODULES}
        if every <= trained and all(name.startswith(kohya_name("blocks.")) for name in trained):
            return []
        return [f"{kohya.name} loads in ComfyUI and musubi-tuner, not in diffusers, whose loader reads that spelling"
                " only for a LoRA on every Linear of every block (train.target_modules attention_ff or all_linear):"
                f" give diffusers {written[0].name} or {named(COMFYUI).name}"]

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: WanVariant) -> Path:
        from .tiny.wan import build_tiny_wan

        return build_tiny_wan(out_dir, variant.per_token_timesteps, experts=variant is A14B)


@cache
def original_names(num_layers: int) -> OriginalNames:
    """Wan's original module names for a T2V transformer of this depth, from diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    seeds = weight_keys((f"blocks.{i}" for i in range(num_layers)), ORIGINAL_BLOCK_MODULES, ORIGINAL_TOP_MODULES)
    return derive_original_names(convert_wan_transformer_to_diffusers, seeds)


WAN = Wan(
    name="wan", label="Wan", pipeline_class="WanPipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser=HIGH_NOISE),
    kohya=Kohya("wan", "networks.lora_wan"),  # musubi-tuner's network module
    latent_patch=2, text_encoder=WanTextEncoder,
    original_formats=(KOHYA, COMFYUI), sampler=FLOW_UNIPC,
    block_lists=("blocks",), size_free_converters={"vae": wan21_vae},
    single_file_markers=("blocks.0.cross_attn.q.weight", "model.diffusion_model.blocks.0.cross_attn.q.weight"),  # diffusers' fixes the VAE's depth
    denoiser_names=("high_noise", "low_noise"),  # A14B's transformer and transformer_2, as the ecosystem names them
)
