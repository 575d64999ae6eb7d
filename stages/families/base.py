"""What every family shares: the spec (Family's fields), the seam's types, and the common defaults.

A family is a frozen dataclass: its fields are data (pipeline class, components, text encoder
class, latent normalisation, LoRA presets, variants), its methods the few functions that differ
between model lines (the seam: Family's docstring). The field defaults serve families with a
diffusers `AutoencoderKL` normalised by scale and shift (SD, Flux.1, Z-Image); a family sets what
differs. Nothing here imports torch or diffusers at module level: flows
import the registry to build cache keys.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from pydantic import Field

from lorapipe.stages.contract import Frozen

from .folders import component_config, load_component, model_index, vae_scale_factor
from .latents import LatentNormalisation, VaePosterior, scale_shift_of

if TYPE_CHECKING:
    import torch

    from .objectives import Objective, ObjectiveParams

TextRecord = dict[str, "torch.Tensor"]  # one caption's tensors, as cached in the sample store
Conditioning = dict[str, "torch.Tensor"]  # a batch's denoiser inputs besides x_t and t, named as its arguments
REFERENCE_LATENTS = "reference_latents"  # the conditioning's reference images (Family.max_references)
IMAGE_EMBEDS = "image_embeds"  # the conditioning image's embedding by the model's image encoder (ImageCondition)
ALL_LINEAR = "all_linear"  # the LoRA preset every family offers
BOTH_DENOISERS = "both"  # train.denoiser: every denoiser of a model that has several, a LoRA each
FLOW_MATCH_EULER = "flow_match_euler"  # the flow-matching pipelines' own FlowMatchEulerDiscreteScheduler
FLOW_UNIPC = "flow_unipc"  # a pipeline's own UniPCMultistepScheduler with flow sigmas (Wan, HiDream-I1 Full)
MODEL_INDEX = "model_index"  # a variant marker's component: the pipeline's own config


@dataclass(frozen=True)
class Components:
    """A model folder's components by role. Which of them a stage's output depends on is one rule
    for every family (`for_stage`), so no stage or flow names a component."""

    text: tuple[str, ...]  # tokenizers and text encoders: text records depend on them
    latent: tuple[str, ...]  # the VAE: latent records and the latent normalisation
    denoiser: str  # what the LoRA adapts; its digest is the model's identity
    scheduler: str | None = "scheduler"  # None: the pipeline makes its scheduler from a config in its code (a modular one)
    other_denoisers: tuple[str, ...] = ()  # a model with several (train.denoiser picks which one trains)
    image: tuple[str, ...] = ()  # an image-to-video model's image encoder: its conditioning image records depend on it
    render: tuple[str, ...] = ()  # what only rendering reads (LTX-2.5's diffusion decoder): evaluate's output depends on it
    lora_prefix: str | None = None  # the denoiser's name in LoRA files, when not its own (adapter_prefix)
    lora_load_kwargs: tuple[tuple[str, Any], ...] = ()  # what the pipeline's load_lora_weights takes to load into it

    def for_stage(self, stage: str) -> tuple[str, ...]:
        parts = {
            "encode": (*self.text, *self.latent, *self.image),
            "train": (*self.denoisers(), *self.schedulers()),  # every denoiser: train.denoiser picks one
            "evaluate": self.all(),
        }
        return parts.get(stage, ())

    def denoisers(self) -> tuple[str, ...]:
        return (self.denoiser, *self.other_denoisers)

    def schedulers(self) -> tuple[str, ...]:
        return () if self.scheduler is None else (self.scheduler,)

    def all(self) -> tuple[str, ...]:
        return (*self.text, *self.latent, *self.image, *self.denoisers(), *self.schedulers(), *self.render)

    def identity(self, digests: dict[str, str]) -> str:
        """The model's identity: its denoiser's weights digest (what a LoRA is made for)."""
        return digests[self.denoiser]

    def adapter_prefix(self) -> str:
        """The denoiser's name in the keys of the diffusers LoRA file (a model's second denoiser takes
        files written for its first, loaded with lora_load_kwargs)."""
        return self.lora_prefix or self.denoiser

    def latent_digest(self, digests: dict[str, str]) -> str:
        """What a latent record's key holds of the model: the VAE's weights digest (its components'
        digests joined, for a family with more than one)."""
        return "+".join(digests[name] for name in self.latent)

    def condition_digest(self, digests: dict[str, str]) -> str:
        """What a conditioning image's record key holds of the model: the VAE's digest and, where the
        denoiser also reads its embedding, the image encoder's."""
        return "+".join(digests[name] for name in (*self.latent, *self.image))


@dataclass(frozen=True)
class Denoiser:
    """One denoiser of a model that has several, each used by the pipeline at its own noise levels
    (train.denoiser picks the one to train)."""

    component: str  # its folder in the model
    sigmas: tuple[float, float]  # the noise levels the pipeline uses it at: low <= sigma < high
    load_kwargs: tuple[tuple[str, Any], ...] = ()  # what the pipeline's load_lora_weights takes to load into it


@dataclass(frozen=True)
class ImageCondition:
    """What an image-to-video model conditions a clip window on: one image, the window's first sampled
    frame unless the dataset names one (a reference). Its record (a latent record of its own, keyed by
    its pixels and placement) reaches predict as conditioning[REFERENCE_LATENTS] (B, 1, C, F', h, w),
    its embedding by the image encoder (Components.image) as conditioning[IMAGE_EMBEDS]."""

    padded: bool  # encoded as a clip of the window's length, the image then zero frames; else the image alone
    embedder: Callable[[Path, str, str], ImageEmbedder] | None = None  # (path, image encoder component, device)


class ImageEmbedder(Protocol):
    """A loaded image encoder: placed pixels (B, 3, H, W) in [-1, 1] -> the embedding (B, L, D) the
    denoiser reads, as the pipeline computes it from the same image, on the CPU."""

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor: ...


class ImageGeometry(Protocol):
    """What a family may condition on besides the text (an encoded Sample has these)."""

    original_size: tuple[int, int]  # (height, width) of the source image
    crop_box: tuple[int, int, int, int]  # (left, top, right, bottom) in resized pixels
    size: tuple[int, int]  # (height, width) of the encoded image
    resized: tuple[int, int] | None  # (height, width) before the crop
    fps: float  # a clip's frames per second (preprocess.video.fps); 0: an image


class TextEncoder(Protocol):
    """A loaded prompt encoder: captions -> one text record each, tensors in the encode dtype. A
    family whose text encoder reads images (text_takes_references) also takes each caption's
    reference images: references[i] for captions[i]."""

    def __call__(self, captions: list[str], references: list[list[Any]] | None = None) -> list[TextRecord]: ...

    def too_long(self, caption: str) -> bool: ...


class LatentEncoder(Protocol):
    """A loaded VAE: pixels (B, 3, H, W) in [-1, 1] -> the posterior's (mean, std), unscaled, on the CPU."""

    def __call__(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TextOptions(Frozen):
    """The user's text-encoding settings; a family resolves them into its text settings and refuses,
    naming the key, what does not apply to it."""

    max_sequence_length: int | None = Field(None, gt=0, description="the text tokens a record holds, for a model"
                                            " whose text encoder takes a length (a CLIP-only model refuses it);"
                                            " null: the model's default (docs/adding-a-family.md, the family table)")


def stack(records: list[TextRecord], name: str) -> torch.Tensor:
    """A batch of fixed-shape records as one float32 tensor (what the step takes)."""
    import torch

    return torch.stack([r[name].float() for r in records])


def pad_sequences(records: list[TextRecord], name: str,
                  length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of variable-length records (L_i, D), stored unpadded, as one float32 tensor zero-padded
    to the batch's longest (B, L, D) and its mask (B, L), True on each record's own tokens: the
    padding rule of the pipelines that read masked prompt embeddings (Z-Image, Qwen-Image).
    `length`: pad to that many tokens instead (Wan's pipeline pads to its max_sequence_length)."""
    import torch

    lengths = [r[name].shape[0] for r in records]
    length = max(lengths) if length is None else length
    padded = torch.zeros(len(records), length, records[0][name].shape[-1])
    mask = torch.zeros(len(records), length, dtype=torch.bool)
    for i, (record, length) in enumerate(zip(records, lengths)):
        padded[i, :length] = record[name].float()
        mask[i, :length] = True
    return padded, mask


def select_linear(model: torch.nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """The names of the model's Linear layers that fully match one of the regular expressions."""
    import torch

    compiled = [re.compile(p) for p in patterns]
    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear) and any(c.fullmatch(name) for c in compiled))


@dataclass(frozen=True)
class Variant:
    """One checkpoint line of a family (Flux.1 dev or schnell, Z-Image base or Turbo, ...): what tells
    it apart in the model's configs, and the values that differ with it."""

    name: str
    tiny_arch: str  # `lorapipe tiny-model --arch` name of its tiny model
    render_steps: int  # evaluate.num_inference_steps unless set
    render_guidance: float  # evaluate.guidance_scale unless set
    markers: tuple[tuple[str, str, Any], ...] = ()  # (component, config key, value) that identify it; () matches all
    distilled: bool = False  # step-distilled: LoRAs trained on it collapse; train on `train_instead`
    train_instead: str | None = None  # the base checkpoint to train on, for a distilled variant (None otherwise)

    def matches(self, model_path: Path) -> bool:
        def config(component: str) -> dict:
            return model_index(model_path) if component == MODEL_INDEX else component_config(model_path, component)

        return all(config(component).get(key) == value for component, key, value in self.markers)


@dataclass(frozen=True)
class LatentGeometry:
    """How image pixels map to a latent record and to the denoiser's tokens, along each side."""

    downsampling: int  # image pixels per latent record pixel (the VAE's downsampling)
    patch: int  # latent pixels per image token side (Family.latent_patch)

    @property
    def pixel_multiple(self) -> int:
        """Image sides must be multiples of this."""
        return self.downsampling * self.patch


@dataclass(frozen=True)
class Kohya:
    """How the files in original names identify the model to kohya-style loaders."""

    base_model: str  # ss_base_model_version
    network_module: str = "networks.lora"  # a plain LoRA's ss_network_module: the trainer's own

    def metadata(self, provenance: dict[str, str], kohya_metadata: dict[str, str]) -> dict[str, str]:
        """The metadata of the files in original names: the run's provenance and kohya's training
        keys, with the family's base model and network module (kohya_metadata's own, a LyCORIS
        type's, wins)."""
        return {"ss_network_module": self.network_module, **provenance, **kohya_metadata,
                "ss_base_model_version": self.base_model}


@dataclass(frozen=True)
class Family(ABC):
    """A model line, and the one seam between the stages and model-specific code.

    Outside stages/families nothing branches on a family or names a model part (`unet`,
    `text_encoder_2`): the stages and flows read the fields and call the methods below on the family
    that `families.for_model(path)` returns, bound to the model's variant (data read from the
    folder's configs). What differs between model lines only as a value is a field: the pipeline
    class, components, text encoder class, latent encoder and normalisation, latent patch, LoRA
    presets, swappable block lists, reference bounds, sampler, the variants' steps and guidance,
    kohya's names, how component files convert (checkpoint_prefixes, size_free_converters). A
    method is left only where behaviour differs. A line that differs only in data
    (SDXL from SD1.x, a variant) is another instance, not another class. Every registered family's
    values, and adding a family step by step: docs/adding-a-family.md.

    The seam, by caller:
      identity and loading (the flow's plan, every stage)
        for_model(path)                this family bound to the model's variant (`variant`)
        components                     what keys each stage (Components.for_stage), the model's
                                       identity (Components.identity) and how its LoRA loads
                                       (adapter_prefix, lora_load_kwargs)
        denoiser_choices, with_denoiser(choice)   a model with several denoisers (Wan 2.2 A14B's
                                       experts): the one train.denoiser trains and its noise levels
        trained_denoisers(choice)      train.denoiser `both`: each of them, one LoRA each
        geometry(path), frames_problem(path, frames)   image (and clip) sizes the model takes
      text records (encode)
        text_settings(path, options)   every setting that changes a record, as data: in each text
                                       record's key and in samples.json's header
        text_encoder(path, settings, dtype, device)   a field, the encoder's class: captions ->
                                       records as the pipeline's encode_prompt makes them
      latent records (encode; train and evaluate apply the normalisation)
        load_latent_encoder(path, device)   pixels -> the posterior's unscaled (mean, std), by the
                                       `latent_encoder` field
        latent_normalisation(path)     recorded with the records, by the `normalisation_of` field
      the objective and the denoiser call (train, and evaluate's losses)
        check_objective(params)        refuses, naming the train key, what does not apply to the model
        objective(path, params)        noise levels, noisy input, target and weight: one definition
                                       for both stages (objectives.Objective)
        load_denoiser(...), conditioning(texts, images, params), predict(denoiser, noisy, t, ...)
                                       the batch's conditioning on the CPU, batch first, records
                                       padded by the family's rule; the prediction in float32, in
                                       the latent layout, as the pipeline calls its denoiser
        loss_region(pred, target)      what of them the loss scores (all, but a conditioning frame)
      references (edit models: preprocess, train, evaluate)
        max_references                 reference images a sample may have (check_references); a
                                       batch's references reach predict as conditioning[REFERENCE_LATENTS]:
                                       (B, K, C, h, w) normalised posterior means at the target's size
        reference_render_kwargs(images)   the pipeline call's arguments for a sample's reference images
        image_condition                an image-to-video model's conditioning image (ImageCondition): a clip
                                       window's one reference, its first sampled frame unless named; its
                                       embedding (Components.image) reaches predict as conditioning[IMAGE_EMBEDS]
      LoRA (train)
        lora_target_modules(denoiser, preset), check_adapter(denoiser), export_lora(...)
                                       presets as regular expressions over module names; the
                                       diffusers file, then the family's original-name files
        block_lists                    the blocks train.blocks_to_swap may keep off the accelerator
      rendering (evaluate)
        render_kwargs(settings, guidance, negative), clip_kwargs(path, num_frames, fps),
        prepare_pipeline(pipe, sampler, objective)   the pipeline call's family arguments and its
                                       sampler; the defaults are the variant's and `sampler`
        (load_render_pipeline, modular.py) the folder's DiffusionPipeline, or for a modular folder its
                                       ModularPipeline, without `render_left_out`, called alike
      the tiny model (the demo, tests)
        build_tiny(out_dir, arch)      `video` and `demo_edits` pick the demo's config and data
    """

    name: str  # the registry key, recorded in encode manifests and text record keys
    label: str  # for people: "Stable Diffusion 1.x/2.x"
    pipeline_class: str  # what renders samples: model_index.json's (or modular_model_index.json's) _class_name
    components: Components
    kohya: Kohya
    text_encoder: Callable[[Path, Any, torch.dtype, str], TextEncoder]  # its class: (path, settings, dtype, device)
    variants: tuple[Variant, ...]  # detection order: the first whose markers match
    variant: Variant | None = None  # set by for_model
    sampler: str = FLOW_MATCH_EULER  # evaluate.scheduler unless set: the pipeline's own scheduler
    latent_encoder: Callable[[Path, str, str], LatentEncoder] = VaePosterior  # (path, VAE component, device)
    normalisation_of: Callable[[Path, str], LatentNormalisation] = scale_shift_of  # (path, VAE component)
    single_file_markers: tuple[str, ...] = ()  # a tensor name that identifies a single-file checkpoint
    single_file_kwargs: dict[str, Any] | None = None  # from_single_file's arguments; None: not converted
    # a component's tensor-name prefix in a whole single-file checkpoint (A1111's `first_stage_model.`), which
    # diffusers' converter for it reads (stages/sources/convert.py); none: its names stand alone
    checkpoint_prefixes: dict[str, str] = field(default_factory=dict)
    # component -> (original tensors, its config) -> diffusers tensors, where diffusers' own converter
    # assumes full sizes (Flux.1's fixes the inner width); else diffusers' converter for the component's class
    size_free_converters: dict[str, Callable[[dict, dict], dict]] = field(default_factory=dict)
    latent_patch: int = 1  # latent pixels per image token side (Flux: 2x2 patches)
    lora_presets: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> what lora_target_modules reads
    block_lists: tuple[str, ...] = ()  # the denoiser's lists of blocks (dotted paths), in run order (swappable_blocks)
    max_references: int = 0  # reference images a sample may have (an edit model's); 0: none
    image_condition: ImageCondition | None = None  # an image-to-video model's conditioning image; None: none
    text_takes_references: bool = False  # its text encoder reads the references too (a vision-language one)
    renders_without_references: bool = True  # False: its pipeline only edits (evaluate's prompts edit a reference)
    render_area_argument: str | None = None  # the pipeline's argument for the output's area, when it rescales to one
    render_left_out: tuple[str, ...] = ()  # what evaluate renders without: optional components, a modular one's sub-blocks
    video: bool = False  # trains on clips and renders them (video.VideoFamily)
    clip_fps: int = 16  # frames per second a clip renders at when the training data has no clips (evaluate.fps unset)
    demo_edits: bool = False  # `lorapipe demo` trains it on edit pairs (an edit model; else with --edit)
    denoiser_names: tuple[str, ...] = ()  # train.denoiser's values where a model has several denoisers
    denoiser_choices: dict[str, Denoiser] = field(default_factory=dict)  # by denoiser_names; set by for_model
    chosen: Denoiser | None = None  # set by with_denoiser on a model with several denoisers

    # ---- identity and loading
    def for_model(self, model_path: Path) -> Family:
        """This family bound to the model's variant: the first of `variants` its configs match."""
        return replace(self, variant=next(v for v in self.variants if v.matches(model_path)))

    def with_denoiser(self, choice: str | None) -> Family:
        """This (bound) family training the denoiser train.denoiser names: refuses, in one line naming
        the key, a choice on a model with one denoiser and no choice (or an unknown one) on a model
        with several."""
        from lorapipe.cache.errors import UserError

        choices = self.denoiser_choices
        if not choices:
            if choice is not None:
                raise UserError(f"train.denoiser: {self.label} has one denoiser, there is none to choose;"
                                f" remove it (it is {choice!r})")
            return self
        if choice not in choices:
            raise UserError(f"train.denoiser: this {self.label} model has {len(choices)} denoisers, each trained by"
                            f" a LoRA of its own: set it to one of {', '.join(choices)} or {BOTH_DENOISERS}"
                            f"{'' if choice is None else f' (not {choice!r})'}")
        picked = choices[choice]
        others = tuple(c for c in self.components.denoisers() if c != picked.component)
        components = replace(self.components, denoiser=picked.component, other_denoisers=others,
                             lora_prefix=self.components.adapter_prefix(), lora_load_kwargs=picked.load_kwargs)
        return replace(self, components=components, chosen=picked)

    def trained_denoisers(self, choice: str | None) -> dict[str, Family]:
        """The families train.denoiser trains, by name: with `both`, every denoiser of a model that has
        several, each bound by with_denoiser; else the one with_denoiser binds, named ''."""
        if choice == BOTH_DENOISERS and self.denoiser_choices:
            return {name: self.with_denoiser(name) for name in self.denoiser_choices}
        return {"": self.with_denoiser(choice)}

    def geometry(self, model_path: Path) -> LatentGeometry:
        """Image pixels per latent pixel (the VAE's downsampling) and per token, along each side."""
        return LatentGeometry(vae_scale_factor(model_path, self.components.latent[0]), self.latent_patch)

    def frames_problem(self, model_path: Path, frames: int) -> str | None:
        """Why the model cannot be trained on a clip window of `frames` frames (None: it can; 0 is an
        image). An image model takes no clip; a video family says which frame counts its VAE takes."""
        return None if frames == 0 else f"{self.label} is an image model: it trains on images, not clips"

    # ---- text records
    @abstractmethod
    def text_settings(self, model_path: Path, options: TextOptions) -> Frozen:
        """Every setting that changes a text record (encoders' roles, hidden layer(s), pooled output,
        max length, padding/mask mode, template) as data: for the text record key, for the encoder,
        and for rendering with what training saw."""

    # ---- latent records
    def load_latent_encoder(self, model_path: Path, device: str) -> LatentEncoder:
        return self.latent_encoder(model_path, self.components.latent[0], device)

    def latent_normalisation(self, model_path: Path) -> LatentNormalisation:
        """Read once at encode time and recorded with the records; train and evaluate apply it."""
        return self.normalisation_of(model_path, self.components.latent[0])

    # ---- the objective and the denoiser
    @abstractmethod
    def check_objective(self, params: ObjectiveParams) -> None:
        """Refuse, naming the train key, a setting that does not apply to this model (no model files
        read: the flow checks a config with it before anything runs)."""

    @abstractmethod
    def objective(self, model_path: Path, params: ObjectiveParams) -> Objective:
        """Timestep sampling, noisy input, target and weight (objectives.py) for this model."""

    def load_denoiser(self, model_path: Path, dtype: torch.dtype) -> torch.nn.Module:
        return load_component(model_path, self.components.denoiser, torch_dtype=dtype)

    @abstractmethod
    def conditioning(self, texts: list[TextRecord], images: list[tuple[ImageGeometry, bool]],
                     params: ObjectiveParams) -> Conditioning:
        """A batch's conditioning on the CPU, from its text records (padded by the family's rule when
        they vary in length) and each image's geometry and whether its latent is the mirrored one.
        Every tensor is batch-first: training selects rows of it (train.prior_target base_output)."""

    @abstractmethod
    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Conditioning, dtype: torch.dtype) -> torch.Tensor:
        """The denoiser's prediction for x_t (latent layout, already on the denoiser's device),
        packed and unpacked as the family needs, in float32, comparable with the objective's target."""

    def loss_region(self, pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts of a prediction and its target the loss scores: all of them, unless part of the
        input is the condition rather than something denoised (an image-to-video model's first frame)."""
        return pred, target

    # ---- LoRA
    @abstractmethod
    def lora_target_modules(self, denoiser: torch.nn.Module, spec: str | tuple[str, ...]) -> list[str]:
        """peft's target_modules for a preset name (or the user's own tuple, passed through)."""

    def check_adapter(self, denoiser: torch.nn.Module) -> None:
        """Refuse, before training starts, an adapter that export_lora could not write (one line
        naming the config key); every adapter on every target is writable unless a family says not."""

    @abstractmethod
    def export_lora(self, denoiser: torch.nn.Module, out_dir: Path, provenance: dict[str, str],
                    kohya_metadata: dict[str, str]) -> list[Path]:
        """Write every LoRA file the family exports (diffusers format first) into out_dir."""

    def export_notes(self, denoiser: torch.nn.Module, written: list[Path]) -> list[str]:
        """Lines for the training log about exported files a loader will not read (the file, which
        loader, which file to give it instead); none unless the family says."""
        return []

    # ---- rendering
    def reference_render_kwargs(self, images: list[Any]) -> dict[str, Any]:
        """The pipeline call's arguments for one sample's reference images (PIL, in order)."""
        return {"image": images[0] if len(images) == 1 else images}

    @abstractmethod
    def render_kwargs(self, settings: Frozen, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        """The pipeline call's family-specific arguments (besides prompt, size, steps and generator)."""

    def clip_kwargs(self, model_path: Path, num_frames: int | None, fps: float) -> dict[str, Any]:
        """The pipeline call's arguments for the length of a rendered clip (evaluate.num_frames; None:
        the model's default) and, for a pipeline conditioned on it, its frame rate `fps`. An image
        model renders no clip: a set num_frames is refused."""
        if num_frames is not None:
            raise ValueError(f"evaluate.num_frames: {self.label} renders images, not clips; remove it")
        return {}

    @abstractmethod
    def prepare_pipeline(self, pipe: Any, sampler: str, objective: Objective) -> None:
        """Set the pipeline's sampler, consistent with what the (LoRA) model was trained to predict."""

    # ---- tests and the demo
    @abstractmethod
    def build_tiny(self, out_dir: Path, arch: str) -> Path:
        """A tiny model of `arch` (a variant's tiny_arch) in out_dir: random weights from a fixed seed,
        tokenizers built offline, byte-identical when rebuilt, loadable by `pipeline_class`."""


def check_references(family: Family, count: int) -> None:
    """Refuse, naming the data keys, samples with more reference images than the model takes."""
    from lorapipe.cache.errors import UserError

    if count > family.max_references:
        takes = f"takes at most {family.max_references}" if family.max_references else "takes none"
        raise UserError(f"data.datasets: samples have {count} reference image(s) (control_dir /"
                        f" reference_columns), but {family.label} {takes}: train an edit model, or remove them")


def swappable_blocks(family: Family, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the family's `block_lists`, in the order the denoiser runs them: those
    train.blocks_to_swap may keep off the accelerator (the last N); [] for a denoiser without a chain
    of blocks (SD's UNet), which refuses it."""
    return [block for name in family.block_lists for block in denoiser.get_submodule(name)]
