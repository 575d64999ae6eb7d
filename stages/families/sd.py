"""Stable Diffusion 1.x/2.x and SDXL: UNet families trained on DDPM timesteps.

The two differ only in data: their text encoders (SD: CLIP's final output; SDXL: the penultimate
hidden states of two CLIP encoders, concatenated, plus the second one's pooled embedding) and SDXL's
size conditioning (original size, crop top-left, target size). SD2-style v-prediction and
`sample` prediction come from the scheduler config (or train.prediction_type).

These reproduce what the stages computed before the family layer, number for number
(tests/test_golden.py): the same records, the same random draws in the same order, the same target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorapipe.stages.contract import Frozen
from lorapipe.stages.lora_formats.original_names import OriginalNames

from .base import (ALL_LINEAR, Components, Conditioning, Family, ImageGeometry, Kohya, TextOptions, TextRecord, Variant,
                   stack)
from .folders import load_component
from .objectives import DDPMObjective, ObjectiveParams

if TYPE_CHECKING:
    import torch

SAMPLERS = {  # evaluate.scheduler -> the diffusers scheduler class that renders with it
    "dpm_solver_multistep": "DPMSolverMultistepScheduler",
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
}
RENDER_STEPS, RENDER_GUIDANCE = 20, 5.0  # with dpm_solver_multistep
FLOW_ONLY = "applies to flow-matching models; {name} samples DDPM timesteps uniformly"


class ClipEncoding(Frozen):
    """One CLIP encoder's part of a text record."""

    encoder: str  # its component folder
    tokenizer: str
    hidden_layer: int | None  # None: the final (layer-normed) output; -2: the penultimate layer's hidden states
    pooled: bool = False  # also its projected pooled embedding (`text_embeds`)


class SDTextSettings(Frozen):
    """Hidden states concatenated over the encoders, each padded to its tokenizer's 77-token window."""

    encoders: tuple[ClipEncoding, ...]


class ClipTextEncoder:
    def __init__(self, model_path: Path, settings: SDTextSettings, dtype: torch.dtype, device: str):
        self.settings, self.dtype, self.device = settings, dtype, device
        self.parts = [(load_component(model_path, e.tokenizer), load_component(model_path, e.encoder), e)
                      for e in settings.encoders]
        for _, model, _ in self.parts:
            model.eval().requires_grad_(False).to(device)

    def too_long(self, caption: str) -> bool:
        tokenizer = self.parts[0][0]
        return len(tokenizer(caption).input_ids) > tokenizer.model_max_length

    def __call__(self, captions: list[str]) -> list[TextRecord]:
        import torch

        hidden, pooled = [], None
        for tokenizer, model, encoding in self.parts:
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids.to(self.device)
            with torch.inference_mode():
                out = model(ids, output_hidden_states=True)
            hidden.append(out.last_hidden_state if encoding.hidden_layer is None
                          else out.hidden_states[encoding.hidden_layer])
            if encoding.pooled:
                pooled = out.text_embeds
        states = torch.cat(hidden, dim=-1).to(self.dtype)
        records = [{"hidden_states": states[i]} for i in range(len(captions))]
        if pooled is not None:
            for i, record in enumerate(records):
                record["pooled"] = pooled[i].to(self.dtype)
        return records


def size_conditioning(image: ImageGeometry, flipped: bool) -> list[int]:
    """SDXL's time ids: original size, crop top-left (mirrored with the latent), target size."""
    left, top = image.crop_box[0], image.crop_box[1]
    if flipped and image.resized is not None:
        left = image.resized[1] - image.crop_box[2]
    return [*image.original_size, top, left, *image.size]


def write_kohya_lora(unet: torch.nn.Module, path: Path, alpha: float, metadata: dict[str, str]) -> None:
    """kohya/A1111/ComfyUI keys (`lora_unet_*`, module names as in diffusers). The `.alpha`
    tensors carry lora_alpha: loaders ignore `ss_network_alpha` metadata."""
    import torch
    from diffusers.utils import convert_state_dict_to_kohya

    from lorapipe.stages.lora_formats.diffusers_format import peft_state_dict, save_safetensors_sorted

    tensors = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in peft_state_dict(unet).items()})
    tensors = {k: torch.tensor(float(alpha)) if k.endswith(".alpha") else v for k, v in tensors.items()}
    save_safetensors_sorted(tensors, metadata, path)


@dataclass(frozen=True)
class StableDiffusion(Family):
    text: SDTextSettings = SDTextSettings(encoders=())
    size_conditioning: bool = False  # SDXL's micro-conditioning on sizes and crop
    sampler: str = "dpm_solver_multistep"
    lora_presets: dict[str, tuple[str, ...]] = field(default_factory=lambda: {  # peft target_modules suffixes
        "attention": ("to_q", "to_k", "to_v", "to_out.0"),
        "attention_ff": ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
    })

    # ---- text
    def text_settings(self, model_path: Path, options: TextOptions) -> SDTextSettings:
        if options.max_sequence_length is not None:
            raise ValueError(f"encode.max_sequence_length: {self.label} encodes CLIP's fixed 77-token window;"
                             " remove the setting")
        return self.text

    # ---- objective and denoiser
    def check_objective(self, params: ObjectiveParams) -> None:
        why = FLOW_ONLY.format(name=self.name)
        params.refuse({"timestep_sampling": why, "loss_weighting": why,
                       "guidance": f"applies to guidance-distilled models; {self.name} has no guidance input"})

    def objective(self, model_path: Path, params: ObjectiveParams) -> DDPMObjective:
        from diffusers import DDPMScheduler

        self.check_objective(params)
        scheduler = DDPMScheduler.from_pretrained(model_path, subfolder=self.components.scheduler)
        prediction = params.prediction_type or scheduler.config.prediction_type
        if prediction not in ("epsilon", "v_prediction", "sample"):
            raise ValueError(f"{model_path}/{self.components.scheduler}: prediction_type {prediction!r} is not"
                             " supported: expected epsilon, v_prediction or sample")
        return DDPMObjective.from_params(scheduler, prediction, params)

    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        import torch

        cond = {"encoder_hidden_states": stack(texts, "hidden_states")}
        if self.size_conditioning:
            cond["text_embeds"] = stack(texts, "pooled")
            cond["time_ids"] = torch.tensor([size_conditioning(image, flipped) for image, flipped in images],
                                            dtype=torch.float32)
        return cond

    def predict(self, unet: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        added = None
        if self.size_conditioning:
            added = {k: conditioning[k].to(dtype) for k in ("text_embeds", "time_ids")}
        return unet(noisy.to(dtype), timesteps, conditioning["encoder_hidden_states"].to(dtype),
                    added_cond_kwargs=added).sample.float()

    # ---- LoRA
    def lora_target_modules(self, unet: torch.nn.Module, spec: str | tuple[str, ...]) -> list[str]:
        import torch

        if spec == ALL_LINEAR:
            return sorted(name for name, m in unet.named_modules() if isinstance(m, torch.nn.Linear))
        return list(self.lora_presets.get(spec, spec))

    def export_lora(self, unet: torch.nn.Module, out_dir: Path, provenance: dict[str, str],
                    kohya_metadata: dict[str, str]) -> list[Path]:
        """The diffusers file, kohya's `lora_unet_*` file (diffusers module names, `.alpha` tensors)
        and ComfyUI's native one (`diffusion_model.<LDM name>.lora_A/lora_B.weight`, ldm_names.py, the
        scale in lora_B); a DoRA, LoKr or LoHa: the diffusers file and the ComfyUI one in LyCORIS keys
        (stages/lora_formats/lycoris.py)."""
        from lorapipe.stages.lora_formats.diffusers_format import (ADAPTER, lora_scale, peft_state_dict,
                                                                   save_safetensors_sorted, write_diffusers_lora)
        from lorapipe.stages.lora_formats.lora_folder import LORA_FILE
        from lorapipe.stages.lora_formats.lycoris import write_lycoris
        from lorapipe.stages.lora_formats.original_names import COMFYUI, KOHYA, fused_lora

        diffusers_file, kohya_file, comfyui_file = (Path(out_dir) / f for f in (LORA_FILE, KOHYA.file, COMFYUI.file))
        write_diffusers_lora(unet, diffusers_file, provenance, self.components.adapter_prefix())
        metadata = self.kohya.metadata(provenance, kohya_metadata)
        lycoris = write_lycoris(unet, self.original_names(unet), out_dir, metadata)
        if lycoris:
            return [diffusers_file, lycoris]
        adapter = unet.peft_config[ADAPTER]
        alpha = adapter.lora_alpha * (math.sqrt(adapter.r) if adapter.use_rslora else 1)  # read as alpha / rank
        write_kohya_lora(unet, kohya_file, alpha, metadata)
        save_safetensors_sorted(fused_lora(peft_state_dict(unet), lora_scale(adapter), self.original_names(unet),
                                           COMFYUI), metadata, comfyui_file)
        return [diffusers_file, kohya_file, comfyui_file]

    def original_names(self, unet: torch.nn.Module) -> OriginalNames:
        """The LDM name of each UNet module that carries an adapter (ldm_names.py)."""
        from lorapipe.stages.lora_formats.lycoris import adapted_modules

        from .ldm_names import unet_original_names

        return unet_original_names(dict(unet.config), adapted_modules(unet))

    # ---- rendering
    def render_kwargs(self, settings: SDTextSettings, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt}

    def prepare_pipeline(self, pipe: Any, sampler: str, objective: DDPMObjective) -> None:
        """Render with `sampler`, predicting what the (LoRA) model was trained to predict."""
        import diffusers

        if sampler not in SAMPLERS:
            raise ValueError(f"evaluate.scheduler: {self.name} renders with one of {', '.join(SAMPLERS)}")
        pipe.scheduler = getattr(diffusers, SAMPLERS[sampler]).from_config(pipe.scheduler.config)
        pipe.scheduler.register_to_config(prediction_type=objective.prediction_type)

    # ---- tiny model
    def build_tiny(self, out_dir: Path, arch: str) -> Path:
        from .tiny.sd import build_tiny_sd

        return build_tiny_sd(out_dir, self.size_conditioning)


LDM_PREFIXES = {"unet": "model.diffusion_model.", "vae": "first_stage_model."}  # A1111's, whole files

SD15 = StableDiffusion(
    name="sd15", label="Stable Diffusion 1.x/2.x", pipeline_class="StableDiffusionPipeline",
    components=Components(text=("text_encoder", "tokenizer"), latent=("vae",), denoiser="unet"),
    kohya=Kohya("sd_v1"), text_encoder=ClipTextEncoder,
    variants=(Variant("sd15", "sd15", RENDER_STEPS, RENDER_GUIDANCE),),
    single_file_markers=("model.diffusion_model.input_blocks.0.0.weight",),
    single_file_kwargs={"safety_checker": None, "requires_safety_checker": False},
    checkpoint_prefixes={**LDM_PREFIXES, "text_encoder": "cond_stage_model.transformer."},
    text=SDTextSettings(encoders=(ClipEncoding(encoder="text_encoder", tokenizer="tokenizer", hidden_layer=None),)),
)
SDXL = StableDiffusion(
    name="sdxl", label="Stable Diffusion XL", pipeline_class="StableDiffusionXLPipeline",
    components=Components(text=("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"), latent=("vae",),
                          denoiser="unet"),
    kohya=Kohya("sdxl_base_v1-0"), text_encoder=ClipTextEncoder,
    variants=(Variant("sdxl", "sdxl", RENDER_STEPS, RENDER_GUIDANCE),), single_file_kwargs={},
    single_file_markers=("model.diffusion_model.label_emb.0.0.weight",),  # the size/crop embedding
    checkpoint_prefixes={**LDM_PREFIXES, "text_encoder": "conditioner.embedders.0.transformer."},
    text=SDTextSettings(encoders=(
        ClipEncoding(encoder="text_encoder", tokenizer="tokenizer", hidden_layer=-2),
        ClipEncoding(encoder="text_encoder_2", tokenizer="tokenizer_2", hidden_layer=-2, pooled=True),
    )),
    size_conditioning=True,
)
