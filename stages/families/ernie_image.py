"""ERNIE-Image: a single-stream flow-matching transformer (shared AdaLN) on Flux.2's 2x2-patchified,
batch-normalised 32-channel latents, conditioned on a Mistral3 model's penultimate hidden states.

As ErnieImagePipeline.encode_prompt does it: each caption tokenized alone (the tokenizer's bos
first, no template, no padding, no mask; a caption of no tokens is the bos alone), Mistral3Model's
`hidden_states[-2]` at every token: a record is the caption's own tokens (L_i, 3072 at full size),
stored unpadded and padded per batch. The pipeline truncates only at the tokenizer's
model_max_length; a record holds at most max_sequence_length tokens (encode warns of a longer
caption). The transformer reads the batch padded to its longest with each record's length
(`text_lens`, which masks the padding and places the image tokens' rope positions after the text).

The prompt enhancer (`pe`, `pe_tokenizer`: a Ministral3 language model, optional) rewrites a
prompt at render time only, sampling; the records are of the user's captions as written, and the
previews render them so (`use_pe=False`), with a pipeline loaded without it: a LoRA learns the
captions it was trained on.

Latents are Flux.2-klein's normalisation (latents.PatchedBatchNorm) with the pipeline's own eps 1e-5
(it ignores the VAE config's batch_norm_eps), the layout the transformer reads as it is (its patch
size is 1); the pipeline passes the scheduler's timestep (1000 sigma) unscaled, and its sigmas are
the scheduler config's static shift of 1 - k / steps.

LoRA presets: attention (`layers.N.self_attention.to_q/to_k/to_v/to_out.0`); + feed-forward
(`mlp.gate_proj/up_proj/linear_fc2`); every Linear of the blocks (the same: the modulation is shared,
outside them). Exports: diffusers format, and the ComfyUI/ai-toolkit file: diffusers' converter from
the original checkpoint (`convert_ernie_image_transformer_checkpoint_to_diffusers`) only strips
`model.diffusion_model.`, so the original names are diffusers' own, under `diffusion_model.`, which
ErnieImageLoraLoaderMixin also reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lorapipe.stages.lora_formats.original_names import OriginalNames, own_names

from .base import Components, Conditioning, Kohya, TextOptions, TextRecord
from .flow import FlowFamily, FlowVariant, presets_field
from .latents import PatchedBatchNorm, patched_batch_norm_of
from .qwen_text import QwenPromptEncoder, QwenPromptSettings, hidden_states

if TYPE_CHECKING:
    import torch

BLOCK = r"layers\.\d+\."
ATTENTION = (BLOCK + r"self_attention\.(to_q|to_k|to_v|to_out\.0)",)
FEED_FORWARD = (BLOCK + r"mlp\.(gate_proj|up_proj|linear_fc2)",)
BATCH_NORM_EPS = 1e-5  # ErnieImagePipeline's, not its VAE config's
TIMESTEP_SCALE = 1000  # the transformer reads the scheduler's timestep, 1000 sigma

VARIANTS = (FlowVariant("ernie-image", "ernie-image", 50, 4.0),)  # the pipeline's defaults, as the model card's


class ErniePromptEncoder(QwenPromptEncoder):
    """Captions -> records {"hidden_states": (L_i, D)}, each caption encoded alone as the pipeline does."""

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch

        s, records = self.settings, []
        for caption in captions:
            ids = self.tokenizer(self.templated(caption), max_length=s.token_window, truncation=True).input_ids
            ids = torch.tensor([ids or [self.tokenizer.bos_token_id or 0]], device=self.device)
            states = hidden_states(self.encoder, s.hidden_layers, input_ids=ids)[0]
            records.append({"hidden_states": states.to(self.dtype).cpu()})
        return records


@dataclass(frozen=True)
class ErnieImage(FlowFamily):
    variants: tuple[FlowVariant, ...] = VARIANTS
    normalisation_of: Callable[[Path, str], PatchedBatchNorm] = partial(patched_batch_norm_of, eps=BATCH_NORM_EPS)
    lora_presets: dict[str, tuple[str, ...]] = presets_field(ATTENTION, FEED_FORWARD, (BLOCK,))
    text_arguments: tuple[str, str] = ("text_bth", "text_mask")  # the transformer takes the mask as its lengths

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> QwenPromptSettings:
        length = self.text_length(options)
        return QwenPromptSettings(system_template="{}", hidden_layers=(-2,), max_sequence_length=length,
                                  token_window=length, pad_to_window=False, keep_padding=False)

    # ---- denoiser
    def predict(self, transformer: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """As ErnieImagePipeline calls its transformer: the normalised latents, 1000 sigma, the texts
        padded to the batch's longest and their lengths."""
        text, mask = (conditioning[name].to(noisy.device) for name in self.text_arguments)
        return transformer(hidden_states=noisy.to(dtype), timestep=(timesteps * TIMESTEP_SCALE).to(dtype),
                           text_bth=text.to(dtype), text_lens=mask.sum(1), return_dict=False)[0].float()

    # ---- LoRA
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        return own_names(transformer)

    # ---- rendering
    def render_kwargs(self, settings: QwenPromptSettings, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt, "use_pe": False}

    # ---- tiny model
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path:
        from .tiny.ernie_image import build_tiny_ernie_image

        return build_tiny_ernie_image(out_dir)


ERNIE_IMAGE = ErnieImage(
    name="ernie-image", label="ERNIE-Image", pipeline_class="ErnieImagePipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="transformer"),
    kohya=Kohya("ernie_image"), latent_patch=2, text_encoder=ErniePromptEncoder, sequence_patch=1,
    single_file_markers=("layers.0.adaLN_sa_ln.weight", "model.diffusion_model.layers.0.adaLN_sa_ln.weight"),
    block_lists=("layers",), render_left_out=("pe", "pe_tokenizer"),
)
