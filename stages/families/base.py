"""What every family shares: the declarative head, the seam's types, and the common defaults.

A family is a frozen dataclass: its fields are data (pipeline class, components, LoRA presets,
variants), its methods the few functions that differ between model lines. The defaults here serve
families with a diffusers `AutoencoderKL` normalised by scale and shift (SD, Flux.1, Z-Image); a
family overrides what differs. Nothing here imports torch or diffusers at module level: flows
import the registry to build cache keys.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import Field

from lorapipe.stages.contract import Frozen

from .folders import empty_component, load_component, vae_scale_factor
from .latents import LatentNormalisation, VaePosterior, scale_shift_of

if TYPE_CHECKING:
    import torch

    from .objectives import Objective, ObjectiveParams

TextRecord = dict[str, "torch.Tensor"]  # one caption's tensors, as cached in the sample store
Conditioning = dict[str, "torch.Tensor"]  # a batch's denoiser inputs besides x_t and t, named as its arguments
REFERENCE_LATENTS = "reference_latents"  # the conditioning's reference images (Family.max_references)
ALL_LINEAR = "all_linear"  # the LoRA preset every family offers


@dataclass(frozen=True)
class Components:
    """A model folder's components by role. Which of them a stage's output depends on is one rule
    for every family (`for_stage`), so no stage or flow names a component."""

    text: tuple[str, ...]  # tokenizers and text encoders: text records depend on them
    latent: tuple[str, ...]  # the VAE: latent records and the latent normalisation
    denoiser: str  # what the LoRA adapts; its digest is the model's identity
    scheduler: str = "scheduler"
    other_denoisers: tuple[str, ...] = ()  # a model with several (train.denoiser picks which one trains)
    lora_prefix: str | None = None  # the denoiser's name in LoRA files, when not its own (Family.lora_prefix)

    def for_stage(self, stage: str) -> tuple[str, ...]:
        parts = {
            "encode": (*self.text, *self.latent),
            "train": (*self.denoisers(), self.scheduler),  # every denoiser: train.denoiser picks one
            "evaluate": self.all(),
        }
        return parts.get(stage, ())

    def denoisers(self) -> tuple[str, ...]:
        return (self.denoiser, *self.other_denoisers)

    def all(self) -> tuple[str, ...]:
        return (*self.text, *self.latent, *self.denoisers(), self.scheduler)

    def latent_digest(self, digests: dict[str, str]) -> str:
        """What a latent record's key holds of the model: the VAE's weights digest (its components'
        digests joined, for a family with more than one)."""
        return "+".join(digests[name] for name in self.latent)


@dataclass(frozen=True)
class Denoiser:
    """One denoiser of a model that has several, each used by the pipeline at its own noise levels
    (train.denoiser picks the one to train)."""

    component: str  # its folder in the model
    sigmas: tuple[float, float]  # the noise levels the pipeline uses it at: low <= sigma < high
    load_kwargs: tuple[tuple[str, Any], ...] = ()  # what the pipeline's load_lora_weights takes to load into it


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

    max_sequence_length: int | None = Field(None, gt=0, description="the text tokens a record holds (Flux.1's"
                                            " T5, the Qwen encoders of Flux.2-klein, Z-Image and Qwen-Image; SD"
                                            " refuses it); null: the model's own (512; Flux.1 schnell 256)")


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
class Family(ABC):
    """A model line, and the one seam between the stages and model-specific code.

    Outside stages/families nothing branches on a family or names a model part (`unet`,
    `text_encoder_2`): the stages and flows call the methods below on the family that
    `families.for_model(path)` returns, bound to the model's variant (Flux.1 dev or schnell, a
    distilled checkpoint: data read from the folder's configs). A family is a declarative head (the
    fields) plus the methods that differ between model lines; a line that differs only in data
    (SDXL from SD1.x, a variant) is another instance, not another class. Adding a family, step by
    step: docs/adding-a-family.md.

    The seam, by caller:
      identity and loading (the flow's plan, every stage)
        components.for_stage(stage)    the components whose digests key a stage (encode: text and
                                       latent; train: denoiser(s) and scheduler; evaluate: all)
        identity(digests)              the denoiser's digest: the model a LoRA is made for
        denoiser_choices(), with_denoiser(choice)   a model with several denoisers (Wan 2.2
                                       A14B's experts): the one train.denoiser trains, its noise
                                       levels (the objective draws only those) and how its LoRA
                                       loads (lora_prefix(), lora_load_kwargs())
        single_file_folder(...)        a single-file checkpoint converted once into a diffusers folder
        pixel_multiple(path), latent_downsampling(path)   image geometry (encode, evaluate)
      text records (encode)
        text_settings(path, options)   every setting that changes a record, as data: in each text
                                       record's key and in samples.json's header
        load_text_encoder(...)         captions -> records as the pipeline's encode_prompt makes
                                       them; variable-length records are stored unpadded
      latent records (encode; train and evaluate apply the normalisation)
        load_latent_encoder(...)       pixels -> the posterior's unscaled (mean, std)
        latent_normalisation(path)     recorded with the records (latents.LatentNormalisation)
      the objective and the denoiser call (train, and evaluate's losses)
        check_objective(params)        refuses, naming the train key, what does not apply to the model
        objective(path, params)        noise levels, noisy input, target and weight: one definition
                                       for both stages (objectives.Objective)
        train_instead()                the base to train on when the model is a distilled checkpoint
        load_denoiser(...), conditioning(texts, images, params), predict(denoiser, noisy, t, ...)
                                       the batch's conditioning on the CPU, batch first, records
                                       padded by the family's rule; the prediction in float32, in
                                       the latent layout, as the pipeline calls its denoiser
      references (edit models: preprocess, train, evaluate)
        max_references, check_references(count)   how many reference images a sample may have; a
                                       batch's references reach predict as conditioning[REFERENCE_LATENTS]:
                                       (B, K, C, h, w) normalised posterior means at the target's size
        reference_render_kwargs(images)   the pipeline call's arguments for a sample's reference images
        renders_without_references     False for a pipeline that only edits: evaluate's prompt grid then
                                       edits the first held-out pair's references
        text_takes_references          its text encoder is called encoder(captions, references): each
                                       caption's reference images (PIL, placed as their latents are),
                                       and the references' content is in that text record's key
      LoRA (train)
        lora_target_modules(denoiser, preset), check_adapter(denoiser), export_lora(...)
                                       presets as regular expressions over module names; the
                                       diffusers file, then the family's original-name files
      memory (train)
        swappable_blocks(denoiser)     the blocks train.blocks_to_swap may keep off the accelerator,
                                       in the order they run (the last N are swapped); [] for a
                                       denoiser without a chain of blocks (SD's UNet), which refuses it
      rendering (evaluate) and the tiny model (the demo, tests)
        render_defaults(), render_kwargs(...), render_size_kwargs(h, w), prepare_pipeline(...),
        build_tiny(out_dir, arch)
        demo_config(edits), demo_settings(), write_demo_data(folder, edits)   what `lorapipe demo`
                                       runs: its config in configs/, the values it sets in it for this
                                       model, and the data that config trains on (edits: generated
                                       edit pairs; demo_edits: an edit model's demo always is)
    """

    name: str  # the registry key, recorded in encode manifests and text record keys
    label: str  # for people: "Stable Diffusion 1.x/2.x"
    pipeline_class: str  # the diffusers pipeline that renders samples (model_index.json's _class_name)
    components: Components
    kohya_base_model: str  # ss_base_model_version in the kohya export
    tiny_arches: tuple[str, ...]  # `lorapipe tiny-model --arch` names this family builds
    kohya_network_module: str = "networks.lora"  # a plain LoRA's ss_network_module: the trainer's own
    single_file_markers: tuple[str, ...] = ()  # a tensor name that identifies a single-file checkpoint
    latent_patch: int = 1  # latent pixels per image token side (Flux: 2x2 patches)
    lora_presets: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> what lora_target_modules reads
    block_lists: tuple[str, ...] = ()  # the denoiser's lists of blocks, in run order (swappable_blocks)
    max_references: int = 0  # reference images a sample may have (an edit model's); 0: none
    text_takes_references: bool = False  # its text encoder reads the references too (a vision-language one)
    renders_without_references: bool = True  # False: its pipeline only edits (evaluate's prompts edit a reference)
    demo_edits: bool = False  # `lorapipe demo` trains it on edit pairs (an edit model; else with --edit)
    chosen: Denoiser | None = None  # set by with_denoiser on a model with several denoisers

    # ---- identity and loading
    def for_model(self, model_path: Path) -> Family:
        """This family bound to the model's variant (its data read from the folder's configs)."""
        return self

    def identity(self, digests: dict[str, str]) -> str:
        """The model's identity: its denoiser's weights digest (what a LoRA is made for)."""
        return digests[self.components.denoiser]

    def denoiser_choices(self) -> dict[str, Denoiser]:
        """train.denoiser's values -> the denoiser each trains; {} for a model with one denoiser."""
        return {}

    def with_denoiser(self, choice: str | None) -> Family:
        """This (bound) family training the denoiser train.denoiser names: refuses, in one line naming
        the key, a choice on a model with one denoiser and no choice (or an unknown one) on a model
        with several."""
        from lorapipe.cache.errors import UserError

        choices = self.denoiser_choices()
        if not choices:
            if choice is not None:
                raise UserError(f"train.denoiser: {self.label} has one denoiser, there is none to choose;"
                                f" remove it (it is {choice!r})")
            return self
        if choice not in choices:
            raise UserError(f"train.denoiser: this {self.label} model has {len(choices)} denoisers, each trained by"
                            f" a LoRA of its own: set it to one of {', '.join(choices)}"
                            f"{'' if choice is None else f' (not {choice!r})'}")
        picked = choices[choice]
        others = tuple(c for c in self.components.denoisers() if c != picked.component)
        components = replace(self.components, denoiser=picked.component, other_denoisers=others,
                             lora_prefix=self.lora_prefix())
        return replace(self, components=components, chosen=picked)

    def lora_prefix(self) -> str:
        """The denoiser's name in the keys of the diffusers LoRA file (a model's second denoiser takes
        files written for its first, loaded with lora_load_kwargs)."""
        return self.components.lora_prefix or self.components.denoiser

    def lora_load_kwargs(self) -> dict[str, Any]:
        """What the pipeline's load_lora_weights takes to load a LoRA into the trained denoiser."""
        return dict(self.chosen.load_kwargs) if self.chosen else {}

    def is_single_file(self, tensor_names: set[str]) -> bool:
        return any(marker in tensor_names for marker in self.single_file_markers)

    def single_file_folder(self, checkpoint: Path, digest: str, models_root: Path, arch_dir: Path | None = None) -> Path:
        """A single-file checkpoint (ComfyUI/A1111 layout) converted once, offline, into a diffusers
        folder under models_root that every stage then loads like any other (`arch_dir`: the
        architecture configs to convert with; default: the ones shipped for the family)."""
        raise ValueError(f"model.path: {checkpoint}: single-file {self.label} checkpoints are not supported yet;"
                         f" give a diffusers-format folder")

    def tiny_arch(self) -> str:
        """The `lorapipe tiny-model --arch` name of this (bound) family's tiny model."""
        return self.tiny_arches[0]

    def train_instead(self) -> str | None:
        """The base checkpoint to train on when the bound model is a known distilled one (None otherwise)."""
        return None

    def pixel_multiple(self, model_path: Path) -> int:
        """Image sides must be multiples of this: the VAE's downsampling times the latent patch."""
        return self.latent_downsampling(model_path) * self.latent_patch

    def frames_problem(self, model_path: Path, frames: int) -> str | None:
        """Why the model cannot be trained on a clip window of `frames` frames (None: it can; 0 is an
        image). An image model takes no clip; a video family says which frame counts its VAE takes."""
        return None if frames == 0 else f"{self.label} is an image model: it trains on images, not clips"

    def latent_downsampling(self, model_path: Path) -> int:
        """Image pixels per latent record pixel, along each side (the VAE's downsampling)."""
        return vae_scale_factor(model_path, self.components.latent[0])

    # ---- text records
    @abstractmethod
    def text_settings(self, model_path: Path, options: TextOptions) -> Frozen:
        """Every setting that changes a text record (encoders' roles, hidden layer(s), pooled output,
        max length, padding/mask mode, template) as data: for the text record key, for the encoder,
        and for rendering with what training saw."""

    @abstractmethod
    def load_text_encoder(self, model_path: Path, settings: Frozen, dtype: torch.dtype, device: str) -> TextEncoder:
        ...

    # ---- latent records
    def load_latent_encoder(self, model_path: Path, device: str) -> LatentEncoder:
        return VaePosterior(model_path, self.components.latent[0], device)

    def latent_normalisation(self, model_path: Path) -> LatentNormalisation:
        """Read once at encode time and recorded with the records; train and evaluate apply it."""
        return scale_shift_of(model_path, self.components.latent[0])

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

    def empty_denoiser(self, model_path: Path) -> torch.nn.Module:
        """The denoiser's modules as load_denoiser builds them, without its weights (on the meta
        device): its structure, at almost no cost."""
        return empty_component(model_path, self.components.denoiser)

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

    # ---- references (edit models)
    def check_references(self, count: int) -> None:
        """Refuse, naming the data keys, samples with more reference images than the model takes."""
        from lorapipe.cache.errors import UserError

        if count > self.max_references:
            takes = f"takes at most {self.max_references}" if self.max_references else "takes none"
            raise UserError(f"data.datasets: samples have {count} reference image(s) (control_dir /"
                            f" reference_columns), but {self.label} {takes}: train an edit model, or remove them")

    def reference_render_kwargs(self, images: list[Any]) -> dict[str, Any]:
        """The pipeline call's arguments for one sample's reference images (PIL, in order)."""
        return {"image": images[0] if len(images) == 1 else images}

    # ---- LoRA
    @abstractmethod
    def lora_target_modules(self, denoiser: torch.nn.Module, spec: str | tuple[str, ...]) -> list[str]:
        """peft's target_modules for a preset name (or the user's own tuple, passed through)."""

    @abstractmethod
    def export_lora(self, denoiser: torch.nn.Module, out_dir: Path, provenance: dict[str, str],
                    kohya_metadata: dict[str, str]) -> list[Path]:
        """Write every LoRA file the family exports (diffusers format first) into out_dir."""

    def original_names_metadata(self, provenance: dict[str, str], kohya_metadata: dict[str, str]) -> dict[str, str]:
        """The metadata of the files in original names: the run's provenance and kohya's training
        keys, with the family's base model and network module (kohya_metadata's own, a LyCORIS
        type's, wins)."""
        return {"ss_network_module": self.kohya_network_module, **provenance, **kohya_metadata,
                "ss_base_model_version": self.kohya_base_model}

    def swappable_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks of `block_lists`, in the order the denoiser runs them."""
        return [block for name in self.block_lists for block in getattr(denoiser, name)]

    def check_adapter(self, denoiser: torch.nn.Module) -> None:
        """Refuse, before training starts, an adapter that export_lora could not write (one line
        naming the config key); every adapter on every target is writable unless a family says not."""

    # ---- rendering
    @abstractmethod
    def render_defaults(self) -> dict[str, Any]:
        """num_inference_steps, guidance_scale and sampler that suit the model (variant)."""

    @abstractmethod
    def render_kwargs(self, settings: Frozen, guidance_scale: float, negative_prompt: str) -> dict[str, Any]:
        """The pipeline call's family-specific arguments (besides prompt, size, steps and generator)."""

    def render_size_kwargs(self, height: int, width: int) -> dict[str, Any]:
        """The pipeline call's arguments, besides height and width, that keep its output at that size
        (a pipeline that rescales to an area of its own is given this one)."""
        return {}

    def clip_kwargs(self, model_path: Path, num_frames: int | None) -> dict[str, Any]:
        """The pipeline call's arguments for the length of a rendered clip (evaluate.num_frames; None:
        the model's default). An image model renders no clip: a set num_frames is refused."""
        if num_frames is not None:
            raise ValueError(f"evaluate.num_frames: {self.label} renders images, not clips; remove it")
        return {}

    def rendered(self, output: Any) -> list[list[Any]]:
        """The pipeline's output as clips: a list of frames (PIL images) per prompt; an image is a
        one-frame clip."""
        return [[image] for image in output.images]

    def clip_fps(self) -> int:
        """Frames per second a rendered clip is written at."""
        return 16

    @abstractmethod
    def prepare_pipeline(self, pipe: Any, sampler: str, objective: Objective) -> None:
        """Set the pipeline's sampler, consistent with what the (LoRA) model was trained to predict."""

    # ---- tests and the demo
    @abstractmethod
    def build_tiny(self, out_dir: Path, arch: str) -> Path:
        """A tiny model of `arch` (one of tiny_arches) in out_dir: random weights from a fixed seed,
        tokenizers built offline, byte-identical when rebuilt, loadable by `pipeline_class`."""

    def demo_config(self, edits: bool = False) -> str:
        """The file in configs/ that `lorapipe demo` runs on this family's tiny model (`edits`: on edit
        pairs, for a family that takes references)."""
        return "edit-demo.yaml" if edits else "demo.yaml"

    def demo_settings(self) -> dict[str, str]:
        """Config values (as `--set` takes them) the demo sets beyond demo_config for this model: on a
        model with several denoisers, the first of train.denoiser's choices."""
        return {"train.denoiser": next(iter(choices))} if (choices := self.denoiser_choices()) else {}

    def write_demo_data(self, folder: Path, edits: bool = False) -> None:
        """Write the data demo_config trains on into folder, keeping the files already there: the
        bundled photos and their captions, or (`edits`) edit pairs generated from them."""
        from lorapipe.stages.demo.photos import DEMO_PHOTOS, copy_demo_photos

        if edits:
            from lorapipe.stages.demo.pairs import write_demo_pairs

            write_demo_pairs(folder, DEMO_PHOTOS)
        else:
            copy_demo_photos(folder)
