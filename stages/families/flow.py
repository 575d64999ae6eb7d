"""What the flow-matching transformer families (Flux.1, Flux.2-klein, Z-Image, Qwen-Image, Wan, LTX-2) share:
the variants' text length and guidance input; the objective built from the scheduler config; the
batch's text records padded with their mask; LoRA presets as regular expressions over module names;
the exports (diffusers format, then the original-name files of `original_formats`); rendering with
the pipeline's own sampler (flow-matching Euler; Wan's UniPC).

A family module fills in the spec (its text encoder class among it) and writes what differs: text
settings, `predict` (and `conditioning` where its denoiser reads the text otherwise),
`original_names` (derived from diffusers' single-file converter) and its tiny builder.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorapipe.stages.contract import Frozen
from lorapipe.stages.lora_formats.original_names import COMFYUI, KeySpelling, OriginalNames, fused_lora

from .base import (Conditioning, Family, ImageGeometry, TextOptions, TextRecord, Variant, pad_sequences,
                   select_linear)
from .folders import component_config
from .objectives import FlowMatchingObjective, ObjectiveParams, TimestepSampling

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class FlowVariant(Variant):
    guidance_embeds: bool = False  # the transformer's guidance input (guidance-distilled)
    max_sequence_length: int = 512  # text tokens the variant was trained with


@dataclass(frozen=True)
class FlowFamily(Family):
    sequence_patch: int = 2  # normalised-latent pixels per image token side (the objective's token count)
    original_formats: tuple[KeySpelling, ...] = (COMFYUI,)  # exported besides the diffusers file
    comfyui_slice_prefix: str | None = None  # ComfyUI maps <prefix><diffusers module> to its rows of a fused weight
    # the denoiser's arguments for the batch's text records padded to its longest, and their mask (`conditioning`)
    text_arguments: tuple[str, str] = ("encoder_hidden_states", "encoder_attention_mask")
    # the scheduler config of a model whose folder has none (Components.scheduler None): its pipeline's, from its code
    code_scheduler_config: tuple[tuple[str, Any], ...] = ()

    @property
    def bound(self) -> FlowVariant:
        if self.variant is None:
            raise RuntimeError(f"the {self.name} family is not bound to a model: use families.for_model(model_path)")
        return self.variant

    def text_length(self, options: TextOptions) -> int:
        """The text tokens a record holds: encode.max_sequence_length, else the variant's."""
        return options.max_sequence_length or self.bound.max_sequence_length

    # ---- objective
    def model_shift(self, scheduler_config: dict) -> TimestepSampling | None:
        """What timestep_sampling.shift "model" means when the pipeline samples otherwise than its
        scheduler config alone says (None: as the config says). A UniPC scheduler with flow sigmas
        (Wan's, HiDream-I1 Full's) shifts statically by its `flow_shift`."""
        if "flow_shift" not in scheduler_config:
            return None  # a FlowMatchEulerDiscreteScheduler: its own `shift`
        return TimestepSampling(shift="static", shift_value=scheduler_config["flow_shift"])

    def check_objective(self, params: ObjectiveParams) -> None:
        why = f"applies to DDPM models; {self.name} is trained by flow matching (see train.timestep_sampling)"
        refused = {"prediction_type": why, "snr_gamma": why, "debiased_estimation": why}
        if not self.bound.guidance_embeds:
            refused["guidance"] = f"{self.label} {self.bound.name} has no guidance input"
        params.refuse(refused)

    def objective(self, model_path: Path, params: ObjectiveParams) -> FlowMatchingObjective:
        self.check_objective(params)
        scheduler = self.components.scheduler
        config = dict(self.code_scheduler_config) if scheduler is None else component_config(model_path, scheduler)
        objective = FlowMatchingObjective.from_scheduler_config(config, params, self.sequence_patch,
                                                                self.geometry(model_path).pixel_multiple,
                                                                self.model_shift(config))
        return replace(objective, sigma_range=self.chosen.sigmas) if self.chosen else objective

    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        """Variable-length text records padded to the batch's longest, with their mask, as
        `text_arguments` (a family whose denoiser reads its text otherwise overrides this)."""
        embeds, mask = pad_sequences(texts, "hidden_states")
        return dict(zip(self.text_arguments, (embeds, mask)))

    # ---- LoRA
    def lora_target_modules(self, transformer: torch.nn.Module, spec: str | tuple[str, ...]) -> list[str]:
        if isinstance(spec, str):
            return select_linear(transformer, self.lora_presets[spec])
        return list(spec)

    @abstractmethod
    def original_names(self, transformer: torch.nn.Module) -> OriginalNames:
        """The module names the family's ComfyUI (and kohya) files use for this transformer's Linear
        layers, and which rows of each the diffusers modules are: the original (non-diffusers) names
        (original_names.derive_original_names), or diffusers' own where ComfyUI maps those itself."""

    def check_adapter(self, transformer: torch.nn.Module) -> None:
        from lorapipe.stages.lora_formats.lycoris import check_writable

        check_writable(transformer, self.original_names(transformer), self.comfyui_slice_prefix)

    def export_lora(self, transformer: torch.nn.Module, out_dir: Path, provenance: dict[str, str],
                    kohya_metadata: dict[str, str]) -> list[Path]:
        from lorapipe.stages.lora_formats.diffusers_format import (ADAPTER, lora_scale, peft_state_dict,
                                                                   save_safetensors_sorted, write_diffusers_lora)
        from lorapipe.stages.lora_formats.lora_folder import LORA_FILE
        from lorapipe.stages.lora_formats.lycoris import write_lycoris

        written = [Path(out_dir) / LORA_FILE]
        write_diffusers_lora(transformer, written[0], provenance, self.components.adapter_prefix())
        adapter, names, lora = transformer.peft_config[ADAPTER], self.original_names(transformer), None
        metadata = self.kohya.metadata(provenance, kohya_metadata)
        lycoris = write_lycoris(transformer, names, out_dir, metadata, self.comfyui_slice_prefix)  # DoRA, LoKr, LoHa
        if lycoris:
            return [*written, lycoris]
        for spelling in self.original_formats:
            lora = lora or peft_state_dict(transformer)
            written.append(Path(out_dir) / spelling.file)
            save_safetensors_sorted(fused_lora(lora, lora_scale(adapter), names, spelling), metadata, written[-1])
        return written

    # ---- rendering
    def render_kwargs(self, settings: Frozen, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        """A pipeline with classifier-free guidance: the scale, the negative prompt ("" as the pipelines
        default to) and the text length training saw (settings.max_sequence_length)."""
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt,
                "max_sequence_length": settings.max_sequence_length}

    def prepare_pipeline(self, pipe: Any, sampler: str, objective: FlowMatchingObjective) -> None:
        if sampler != self.sampler:
            raise ValueError(f"evaluate.scheduler: {self.label} renders with {self.sampler}, not {sampler}")

    def build_tiny(self, out_dir: Path, arch: str) -> Path:
        return self.build_tiny_variant(Path(out_dir), next(v for v in self.variants if v.tiny_arch == arch))

    @abstractmethod
    def build_tiny_variant(self, out_dir: Path, variant: FlowVariant) -> Path: ...


def refuse_negative_prompt(negative_prompt: str, why: str) -> None:
    """Refuse a negative prompt the pipeline would not read (`why`: what it does instead)."""
    if negative_prompt:
        raise ValueError(f"evaluate.negative_prompt: {why}; remove it")


def regex_presets(attention: tuple[str, ...], feed_forward: tuple[str, ...],
                  blocks: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The three presets every flow family offers, as regular expressions over module names:
    attention; attention + feed-forward; every Linear of the blocks (kohya's "all blocks": the
    embedders and the final layer are left out)."""
    from .base import ALL_LINEAR

    return {"attention": attention, "attention_ff": (*attention, *feed_forward),
            ALL_LINEAR: tuple(block + ".+" for block in blocks)}


def presets_field(attention: tuple[str, ...], feed_forward: tuple[str, ...], blocks: tuple[str, ...]):
    return field(default_factory=lambda: regex_presets(attention, feed_forward, blocks))
