"""HiDream-I1 (Full, Dev and Fast): a sparse (mixture-of-experts) flow-matching transformer on
Flux.1's 16-channel latents, conditioned on two CLIPs' pooled outputs, T5 and the hidden states of
many Llama 3.1 layers, one per block.

Text, as HiDreamImagePipeline.encode_prompt does it: both CLIPs' projected text embeddings
(`pooled`, their concatenation) over min(max_sequence_length, 218) tokens padded; T5's last hidden
state (`t5_states`) and the Llama's hidden states after each of its layers (`llama_states`, the
layers' outputs up to the last one the transformer's `llama_layers` reads, stacked), each over
max_sequence_length (128) tokens padded with the attention mask given to the encoder: the
transformer reads every position, so records keep the padding (fixed shapes, stacked per batch).
Latents are `(z - shift_factor) * scaling_factor` (Flux.1's VAE), cached unpacked; the transformer
patchifies them itself (a non-square image's tokens padded to its max_seq, with a mask), reads
1000 sigma as its timestep and predicts `x0 - noise`, so `predict` negates it. In training mode it
returns its tokens unpatchified otherwise, which `predict` undoes.

Variants are data, told apart by the scheduler the published folders carry: Full (UniPC with
flow_shift 3.0, 50 steps, guidance 5), Dev (Euler, shift 6.0, 28 steps, no guidance) and Fast
(Euler, shift 3.0, 16 steps, no guidance); Dev and Fast are distilled from Full, on which the
family trains instead. The pipeline rescales every render to its default area (1024 x 1024 at full
size); evaluate keeps its resolution by giving that area as `max_area` (prepare_pipeline).

LoRA presets: attention (the double-stream blocks' attn1.to_q/to_k/to_v/to_out and their text
stream's *_t, the single-stream blocks' attn1.to_q/to_k/to_v/to_out); attention + feed-forward
(each block's image feed-forward ff_i: the mixture's shared and routed experts' w1/w2/w3, the
router's gate being a weight of its own, not a Linear; the double blocks' text feed-forward ff_t);
every Linear of the blocks (adds adaLN_modulation.1). Exports: diffusers format, and ComfyUI's
file: diffusers' single-file converter for HiDream keeps the original names (it only strips
`model.diffusion_model.`), so the file holds diffusers' module names under `diffusion_model.`, which
diffusers' HiDream LoRA loader reads too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from lorapipe.stages.contract import Frozen
from lorapipe.stages.lora_formats.original_names import COMFYUI, OriginalNames, own_names

from .base import (FLOW_MATCH_EULER, FLOW_UNIPC, Components, Conditioning, Family, ImageGeometry, Kohya,
                   TextOptions, TextRecord, stack)
from .flow import FlowFamily, FlowVariant, presets_field, refuse_negative_prompt
from .folders import component_config, load_component
from .objectives import FlowMatchingObjective, ObjectiveParams

if TYPE_CHECKING:
    import torch

DOUBLE, SINGLE = r"double_stream_blocks\.\d+\.block\.", r"single_stream_blocks\.\d+\.block\."
ATTENTION = (DOUBLE + r"attn1\.(to_q|to_k|to_v|to_out)(_t)?", SINGLE + r"attn1\.(to_q|to_k|to_v|to_out)")
FEED_FORWARD = (r"(double|single)_stream_blocks\.\d+\.block\.ff_i\.((shared_experts|experts\.\d+)\.)?w[123]",
                DOUBLE + r"ff_t\.w[123]")
CLIP_TOKENS = 218  # the pipeline's bound on the CLIPs' tokens
TIMESTEP_SCALE = 1000  # the pipeline's timesteps are 1000 sigma, as the transformer reads them
FULL = "HiDream-ai/HiDream-I1-Full"
MAX_TOKENS = 128  # the pipeline's default max_sequence_length
AREA_MARGIN = 1 + 2 ** -20  # AtArea's side scale


@dataclass(frozen=True)
class HiDreamVariant(FlowVariant):
    sampler: str = FLOW_MATCH_EULER  # the scheduler its folder carries


VARIANTS = (  # the published folders' schedulers and model cards' steps and guidance
    HiDreamVariant("full", "hidream-i1", 50, 5.0, markers=(("scheduler", "_class_name", "UniPCMultistepScheduler"),),
                   max_sequence_length=MAX_TOKENS, sampler=FLOW_UNIPC),
    HiDreamVariant("dev", "hidream-i1-dev", 28, 0.0, markers=(("scheduler", "shift", 6.0),),
                   max_sequence_length=MAX_TOKENS, distilled=True, train_instead=FULL),
    HiDreamVariant("fast", "hidream-i1-fast", 16, 0.0, max_sequence_length=MAX_TOKENS, distilled=True,
                   train_instead=FULL),
)


class HiDreamTextSettings(Frozen):
    max_sequence_length: int = Field(gt=0, description="T5 and Llama tokens, padded")
    clip_length: int = Field(gt=0, description="CLIP tokens, padded: min(max_sequence_length, 218)")
    llama_layers: int = Field(gt=0, description="the Llama's hidden states kept, after its first layers")


class HiDreamTextEncoder:
    """HiDreamImagePipeline.encode_prompt, batched: the CLIPs' pooled embeddings, T5's and the Llama's
    hidden states."""

    def __init__(self, model_path: Path, settings: HiDreamTextSettings, dtype: torch.dtype, device: str):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.tokenizers = [load_component(model_path, f"tokenizer{suffix}") for suffix in ("", "_2", "_3", "_4")]
        self.tokenizers[3].pad_token = self.tokenizers[3].eos_token  # as the pipeline sets it
        self.encoders = [load_component(model_path, f"text_encoder{suffix}").eval().requires_grad_(False).to(device)
                         for suffix in ("", "_2", "_3", "_4")]

    def _lengths(self) -> list[int]:
        s, t5, llama = self.settings, self.tokenizers[2], self.tokenizers[3]
        return [s.clip_length, s.clip_length, min(s.max_sequence_length, t5.model_max_length),
                min(s.max_sequence_length, llama.model_max_length)]

    def too_long(self, caption: str) -> bool:
        return any(len(tokenizer(caption).input_ids) > length
                   for tokenizer, length in zip(self.tokenizers, self._lengths()))

    def _tokens(self, i: int, captions: list[str]):
        return self.tokenizers[i](captions, padding="max_length", max_length=self._lengths()[i], truncation=True,
                                  return_tensors="pt").to(self.device)

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch

        clip, clip_2, t5, llama = self.encoders
        with torch.inference_mode():
            pooled = torch.cat([encoder(self._tokens(i, captions).input_ids, output_hidden_states=True)[0]
                                for i, encoder in enumerate((clip, clip_2))], dim=-1)
            t5_tokens, llama_tokens = self._tokens(2, captions), self._tokens(3, captions)
            t5_states = t5(t5_tokens.input_ids, attention_mask=t5_tokens.attention_mask)[0]
            hidden = llama(llama_tokens.input_ids, attention_mask=llama_tokens.attention_mask,
                           output_hidden_states=True).hidden_states
            layers = torch.stack(hidden[1:1 + self.settings.llama_layers], dim=1)  # (B, K, L, D)
        return [{"pooled": pooled[i].to(self.dtype).cpu(), "t5_states": t5_states[i].to(self.dtype).cpu(),
                 "llama_states": layers[i].to(self.dtype).cpu()} for i in range(len(captions))]


@dataclass(frozen=True)
class HiDream(FlowFamily):
    variants: tuple[HiDreamVariant, ...] = VARIANTS
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (DOUBLE, SINGLE))

    def for_model(self, model_path: Path) -> Family:
        """Bound to the variant, which renders with the scheduler its folder carries."""
        bound = super().for_model(model_path)
        return replace(bound, sampler=bound.variant.sampler)

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> HiDreamTextSettings:
        length = self.text_length(options)
        read = component_config(model_path, self.components.denoiser)["llama_layers"]
        return HiDreamTextSettings(max_sequence_length=length, clip_length=min(length, CLIP_TOKENS),
                                   llama_layers=max(read) + 1)

    # ---- denoiser
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        return {"pooled_embeds": stack(texts, "pooled"), "encoder_hidden_states_t5": stack(texts, "t5_states"),
                "encoder_hidden_states_llama3": stack(texts, "llama_states")}

    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As HiDreamImagePipeline calls its transformer: the latents (it patchifies them), 1000 sigma
        in float32, the Llama's layers first; the output negated."""
        text = {name: value.to(noisy.device, dtype) for name, value in conditioning.items()}
        text["encoder_hidden_states_llama3"] = text["encoder_hidden_states_llama3"].transpose(0, 1)
        out = transformer(hidden_states=noisy.to(dtype), timesteps=(timesteps * TIMESTEP_SCALE).to(noisy.device),
                          return_dict=False, **text)[0]
        if transformer.training and not transformer.config.force_inference_output:
            out = unpatchified(out, noisy.shape, transformer.config.patch_size)
        return -out.float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        """Each Linear under its own name: diffusers' single-file converter for HiDream keeps the
        original names (it only strips `model.diffusion_model.`)."""
        return own_names(transformer)

    # ---- rendering
    def prepare_pipeline(self, pipe: Any, sampler: str, objective: FlowMatchingObjective) -> None:
        """The pipeline rendering at the area evaluate asks for (`max_area`) rather than its own."""
        super().prepare_pipeline(pipe, sampler, objective)
        if not isinstance(pipe, AtArea):
            pipe.__class__ = type(f"{type(pipe).__name__}AtArea", (AtArea, type(pipe)), {})

    def render_kwargs(self, settings: HiDreamTextSettings, guidance_scale: float,
                      negative_prompt: str) -> dict[str, Any]:
        if self.bound.distilled:
            refuse_negative_prompt(negative_prompt, f"HiDream-I1 {self.bound.name} renders without guidance and"
                                                    " ignores negative prompts")
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt,
                "max_sequence_length": settings.max_sequence_length}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: HiDreamVariant) -> Path:
        from .tiny.hidream import build_tiny_hidream

        return build_tiny_hidream(out_dir, variant.name)


class AtArea:
    """A HiDreamImagePipeline that takes the area to render at (`max_area`, pixels): the pipeline
    rescales every size to the area of its default_sample_size, then floors each side to a multiple of
    16, so the area is set a hair above: a rounding below it would lose a whole multiple."""

    def __call__(self, *args: Any, max_area: int, **kwargs: Any) -> Any:
        self.default_sample_size = math.sqrt(max_area) * AREA_MARGIN / self.vae_scale_factor
        return super().__call__(*args, **kwargs)


def unpatchified(tokens: torch.Tensor, shape: torch.Size, patch: int) -> torch.Tensor:
    """The transformer's training-mode output (B, C, max_seq or h/p x w/p, p x p) as latents (B, C, h, w)."""
    b, c, h, w = shape
    image = tokens[:, :, :(h // patch) * (w // patch)].reshape(b, c, h // patch, w // patch, patch, patch)
    return image.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)


HIDREAM = HiDream(
    name="hidream-i1", label="HiDream-I1", pipeline_class="HiDreamImagePipeline",
    components=Components(text=("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4", "tokenizer",
                                "tokenizer_2", "tokenizer_3", "tokenizer_4"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("hidream_i1"), latent_patch=2, text_encoder=HiDreamTextEncoder, sampler=FLOW_UNIPC,
    original_formats=(COMFYUI,), render_area_argument="max_area",
    single_file_markers=("double_stream_blocks.0.block.adaLN_modulation.1.bias",  # diffusers' (and the original) names
                         "model.diffusion_model.double_stream_blocks.0.block.adaLN_modulation.1.bias"),
    block_lists=("double_stream_blocks", "single_stream_blocks"),
)
