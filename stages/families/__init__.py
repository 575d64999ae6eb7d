"""Model families: everything that differs between model lines (SD1.x/2.x, SDXL, Flux.1,
Flux.2-klein, Z-Image, Qwen-Image, Wan, LTX-2), behind one seam. Outside this package no code should branch on
a family or name a model part.

A family (base.Family) is a frozen dataclass: a declarative head (pipeline class, components by
role, LoRA presets, kohya base-model name, tiny arches, single-file markers, variants) and the
functions below. `for_model(path)` detects a model's family and binds it to its variant (Flux.1
dev or schnell, read from the transformer config); stages call the bound family. The flow-matching
families share flow.FlowFamily: variants as data (FlowVariant: render steps and guidance, markers
read from the configs, `distilled` and the base to train instead), `family.train_instead()` names
that base for a distilled checkpoint (Z-Image Turbo, the distilled Klein): train warns once with it.

The seam (what a stage calls; all model-dependent data is read from the folder's configs), and who calls it:
  identity and loading
    for_model(path, declared) -> Family            registry: folder by pipeline class, single file by markers
                                                   (flows/plan.py Context, every stage)
    family.components.for_stage(stage) -> names    what a stage's key depends on (encode: text + latent;
                                                   train: denoiser + scheduler; evaluate: all) (flows/plan.py)
    family.components.all(), .latent_digest(digests)   a single file's components (stages/models.py); the
                                                   latent records' model ingredient (encode)
    family.identity(digests) -> str                the denoiser's digest: the model's identity (flows/plan.py)
    family.single_file_folder(file, digest, root)  a single-file checkpoint as a diffusers folder, once (flows)
    family.pixel_multiple(path) -> int             image sides must be multiples of it (SD 8, Flux 16) (encode,
                                                   evaluate)
    family.latent_downsampling(path) -> int        image pixels per latent record pixel (encode: loss masks)
    family.tiny_arch()                             the --arch name of a (bound) tiny model (the demo)
  text records (encode)
    family.text_settings(path, TextOptions) -> Frozen    every setting that changes a record, as data: in the
                                                   text record's key and samples.json's header
    family.load_text_encoder(path, settings, dtype, device) -> TextEncoder   captions -> records; too_long
  latent records (unscaled posterior mean/std; the normalisation is data recorded with them) (encode)
    family.load_latent_encoder(path, device) -> LatentEncoder   pixels -> (mean, std)
    family.latent_normalisation(path) -> LatentNormalisation    .apply(z); recorded in samples.json, read back
      by latents.normalisation_from_json (stages/encoded.py) and applied by train and evaluate; kinds:
      scale_shift, channel_mean_std (Qwen-Image, Wan, LTX-2), patched_batch_norm (Flux.2: apply returns the
      2x2-patchified layout, so noise is drawn after apply, in its shape)
  the objective (one definition for train and evaluate) and the denoiser call
    family.check_objective(ObjectiveParams)        refuses train settings that do not apply (train, before launch)
    family.train_instead() -> str | None           the base to train on for a known distilled checkpoint (train:
                                                   one warning); evaluate.render_model previews on the distilled one
    family.objective(path, ObjectiveParams) -> Objective
      objective.draw(latents, rng) -> (noise, t, input_noise)  train: from the micro-batch's generator
      objective.fixed_timesteps(steps) -> t                 evaluate: fixed levels (validates the range)
      objective.noised(latents, noise, t[, input_noise]) -> Noised  noisy, timesteps, target, weight: both stages
      objective.loss(pred, target, weight[, mask]) -> loss  train's loss (evaluate scores plain MSE)
      objective.prediction                                  epsilon, v_prediction, sample or flow (metrics)
    family.load_denoiser(path, dtype) -> nn.Module          (train; evaluate takes the pipeline's)
    family.conditioning(text records, [(geometry, flipped)], params) -> dict   on the CPU, per batch;
      records arrive as stored, so a family with variable-length records pads them here by its rule
      (base.pad_sequences: zeros to the batch's longest and a bool mask; Qwen-Image drops the mask
      when nothing is padded, as its pipeline does; Wan pads to the length its records carry, unmasked).
      A geometry is the encoded Sample: size, crop, and a clip's frames and frame rate (LTX-2's positions).
      Every value is a tensor with the batch first.
    family.predict(denoiser, noisy, t, conditioning, dtype) -> float32 prediction in the latent layout
  LoRA (train)
    family.lora_target_modules(denoiser, preset or tuple) -> peft target_modules
    family.export_lora(denoiser, out_dir, provenance, kohya_metadata) -> [diffusers file, then the family's
      original-name files: SD kohya + comfyui; Flux.1, Flux.2, Wan kohya + comfyui; Z-Image, Qwen-Image, LTX-2 comfyui]
    checkpoints: stages/train/lora_files.py write/load_diffusers_lora(..., prefix=components.denoiser)
  rendering (evaluate) and tests
    family.render_defaults() / render_kwargs(settings, guidance, negative) / prepare_pipeline(pipe, sampler, objective)
    family.build_tiny(out_dir, arch); build_tiny_model(out_dir, arch); tiny_arches() (the CLI, the demo, tests)

Adding a family: write stages/families/<family>.py (a Family subclass, or an existing class when the
new line differs only in data, as SDXL does from SD1.x; its data head first; its text settings model;
`objective` usually FlowMatchingObjective.from_scheduler_config; `conditioning` and `predict` as its
pipeline calls the denoiser; LoRA presets as regular expressions; the original-name export derived
with original_names.derive_original_names from diffusers' convert_<family>_transformer_checkpoint_to_
diffusers; override load_latent_encoder/latent_normalisation when its VAE is not a scale-and-shift
AutoencoderKL, adding a kind to latents.LatentNormalisation), its tiny builder (tiny_<family>.py:
inline configs, tokenizer built offline, byte-identical), and register it in FAMILIES. Copy
tests/test_families_flux1.py (and a golden-number variant in tests/test_golden.py, and the family's
invalidation counts as tests/test_invalidation_flux1.py shows): byte-identical tiny build; text record == the pipeline's encode_prompt;
normalisation == the pipeline's VAE encode; predict == the pipeline's transformer call (forward hook);
the objective; presets; each export loaded through diffusers' loaders with fuse_lora's weight change.
"""
from __future__ import annotations

from pathlib import Path

from lorapipe.cache.errors import UserError

from .base import ALL_LINEAR, Components, Family, TextOptions
from .flux1 import FLUX1
from .flux2 import FLUX2_KLEIN
from .folders import check_weights_file, is_single_file, model_index
from .ltx2 import LTX2
from .objectives import ObjectiveParams, TimestepSampling
from .qwenimage import QWEN_IMAGE
from .sd import SD15, SDXL
from .wan import WAN
from .zimage import ZIMAGE

FAMILIES: dict[str, Family] = {family.name: family for family in (SD15, SDXL, FLUX1, FLUX2_KLEIN, ZIMAGE, QWEN_IMAGE,
                                                                  WAN, LTX2)}
# single files: SDXL's marker before SD1.x's, which SDXL checkpoints also carry; Flux.2's before Flux.1's,
# whose markers Flux.2 checkpoints also carry
SINGLE_FILE_DETECTION = (SDXL, SD15, FLUX2_KLEIN, FLUX1, ZIMAGE, QWEN_IMAGE)

__all__ = ["ALL_LINEAR", "Components", "FAMILIES", "Family", "ObjectiveParams", "TextOptions", "TimestepSampling",
           "build_tiny_model", "for_model", "get", "is_single_file", "tiny_arches"]


def get(name: str) -> Family:
    """The registered family `name` (not yet bound to a model's variant: see for_model)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: expected one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def for_model(model_path: Path, declared: str | None = None) -> Family:
    """The family of a diffusers folder (from its pipeline class) or of a single-file checkpoint
    (declared, or from its tensor names), bound to the model's variant. `declared` is
    model.family: for a folder it must agree."""
    model_path = Path(model_path)
    if is_single_file(model_path):
        return get(declared) if declared else single_file_family(model_path)
    name = model_index(model_path).get("_class_name")
    family = next((f for f in FAMILIES.values() if f.pipeline_class == name), None)
    if family is None:
        supported = ", ".join(f.pipeline_class for f in FAMILIES.values())
        raise UserError(f"{model_path}/model_index.json: unsupported pipeline class {name!r} (supported: {supported})")
    if declared and declared != family.name:
        raise ValueError(f"model.family is {declared} but {model_path}/model_index.json is a {family.name} model")
    return family.for_model(model_path)


def single_file_family(path: Path) -> Family:
    """The family whose marker tensor the checkpoint holds (read from its header only)."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise UserError(f"model.path: {path} is not a file")
    check_weights_file(Path(path))
    with safe_open(path, "pt") as f:
        names = set(f.keys())
    family = next((f for f in SINGLE_FILE_DETECTION if f.is_single_file(names)), None)
    if family is None:
        raise ValueError(f"model.path: {path} holds none of the tensors that identify a {', '.join(FAMILIES)}"
                         " checkpoint in the original layout; give a diffusers folder, or set model.family")
    return family


def tiny_arches() -> dict[str, Family]:
    """`lorapipe tiny-model --arch` names -> the family that builds them; the first is the default."""
    return {arch: family for family in FAMILIES.values() for arch in family.tiny_arches}


def build_tiny_model(out_dir: Path, arch: str = "sd15") -> Path:
    arches = tiny_arches()
    if arch not in arches:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(arches)}")
    return arches[arch].build_tiny(Path(out_dir), arch)
