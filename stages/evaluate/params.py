"""The evaluate stage's settings and inputs. Imports nothing heavy: flows load this to build keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from lorapipe.stages.contract import Frozen, JsonInputs, OutputFile

VERSION = "3"  # 2: fixed noise and loss subset seeded by content, not file name; 3: clips at the trained fps
GRID, METRICS, REPORT = "grid.png", "metrics.json", "report.md"
ANIMATED_GRID, CLIPS_DIR = "grid.webp", "clips"  # a video model's grid of clips, animated; each clip as an mp4
CHECKPOINT_CHART, CHECKPOINT_LOSSES = "checkpoint_loss.png", "checkpoint_losses.json"  # with checkpoints
EDIT_GRID = "edit_grid.png"  # held-out edit pairs: reference | base | LoRA per scale | target
OUTPUT_FILES = (OutputFile(GRID, "sample grid"), OutputFile(ANIMATED_GRID, "animated sample grid"),
                OutputFile(CLIPS_DIR, "clips", folder=True), OutputFile(EDIT_GRID, "edit grid"),
                OutputFile(METRICS, "metrics"), OutputFile(REPORT), OutputFile(CHECKPOINT_CHART),
                OutputFile(CHECKPOINT_LOSSES))
LOCAL_PATHS = ("clip_model", "fid_reference", "inception_weights", "render_model")  # keyed by content, not path


class EvalParams(Frozen):
    """Every setting that changes evaluate's output."""

    prompts: tuple[str, ...] = Field(min_length=1, description="the grid's prompts, one row per prompt and seed")
    seeds: tuple[int, ...] = Field((0, 1), min_length=1, description="one rendered image per prompt and seed, the"
                                   " same seed in every column")
    lora_scales: tuple[float, ...] = Field((1.0,), min_length=1, description="the LoRA's strengths, one grid"
                                           " column each, after the base model's column")
    num_inference_steps: int | None = Field(None, ge=1, description="sampler steps per image; null: the rendering"
                                            " model's default (docs/adding-a-family.md, the family table)")
    guidance_scale: float | None = Field(None, description="null: the rendering model's default"
                                         " (docs/adding-a-family.md, the family table)")
    negative_prompt: str = Field("", description="for the families that take one (some refuse it:"
                                 " docs/adding-a-family.md, the family table)")
    resolution: int = Field(64, gt=0, multiple_of=8, description="the rendered images' side in pixels (a multiple"
                            " of the family's: SD 8, the flow-matching families 16)")
    num_frames: int | None = Field(None, ge=1, description="frames of each rendered clip (video models); null: the"
                                   " model's default")
    fps: float | None = Field(  # unset: out of the key (the rate training read is in the encoded data's digest)
        None, gt=0, exclude_if=lambda v: v is None, description="frames per second rendered clips play at, and the"
        " frame rate a pipeline that takes one (LTX-2) renders for (video models); null: the rate the training"
        " clips were sampled at (preprocess.video.fps), or the model's own when it trained on stills only")
    scheduler: Literal["dpm_solver_multistep", "ddim", "euler", "flow_match_euler", "flow_unipc"] | None = Field(
        None, description="the sampler; null: the model's (SD dpm_solver_multistep; flow-matching image models"
        " flow_match_euler; Wan flow_unipc)")
    loss_timesteps: tuple[int, ...] = Field((100, 300, 500, 700, 900), min_length=1, description="the noise levels"
                                            " of the denoising loss, as steps out of the model's training"
                                            " timesteps (flow matching: sigma = step / num_train_timesteps)")
    loss_seed: int = Field(0, description="seeds the denoising loss's fixed noise and its subset of samples")
    loss_samples: int | None = Field(256, ge=1, description="samples per split the denoising loss scores (a fixed"
                                     " subset); null: every sample, at a cost that grows with the data")
    clip_model: str | None = Field(None, description="a local CLIP model folder for the CLIP score; unset: the"
                                   " score is skipped")
    fid_reference: str | None = Field(None, description="a folder of reference images for FID and KID (with"
                                      " inception_weights); unset: skipped")
    inception_weights: str | None = Field(None, description="torch-fidelity's Inception-v3 weights file"
                                          " (pt_inception-2015-12-05) for FID and KID; unset: skipped")
    edit_pairs: int = Field(  # at its default out of the key: evaluations without edit pairs keep theirs
        4, ge=0, exclude_if=lambda v: v == 4, description="held-out edit pairs (targets with reference images)"
        " rendered into edit_grid.png for each seed, with their distance to the target in metrics.json")
    render_model: str | None = Field(None, description="a diffusers folder of another checkpoint of the same family"
                                     " (Z-Image Turbo, the distilled Klein) that renders the grid with its own"
                                     " steps and guidance; the losses stay on the training model")

    @field_validator("prompts")
    @classmethod
    def _prompts_not_blank(cls, prompts: tuple[str, ...]) -> tuple[str, ...]:
        if any(not p.strip() for p in prompts):
            raise ValueError("every prompt must have text")
        return prompts

    @field_validator("lora_scales", "loss_timesteps")
    @classmethod
    def _unique(cls, values: tuple) -> tuple:
        if len(set(values)) != len(values):
            raise ValueError(f"values must be unique, got {list(values)}")
        return values

    @field_validator("loss_timesteps")
    @classmethod
    def _non_negative(cls, values: tuple[int, ...]) -> tuple[int, ...]:
        if min(values) < 0:
            raise ValueError("timesteps must be >= 0")
        return values


class EvalOptions(Frozen):
    """Settings that change speed, not what is measured.

    render_batch_size > 1 renders several seeds of a prompt per pipeline call: faster on a GPU,
    but batched matrix products round differently, so a few pixels may differ by one level from
    batch size 1 (measured on CPU). Keep 1 where rebuilt grids must match byte for byte.
    """

    render_batch_size: int = Field(1, ge=1, description="seeds rendered per pipeline call: faster on a GPU, but a"
                                   " few pixels may differ from batch size 1")
    device: str | None = Field(None, description="the torch device evaluate runs on (cpu, cuda, cuda:1); null:"
                               " cuda when available, else cpu")
    cpu_threads: int | None = Field(None, gt=0, description="torch threads of the evaluation; default: the config's"
                                    " cpu_threads")


@dataclass(frozen=True)
class EvalInputs(JsonInputs):
    model_path: Path  # diffusers-format model folder
    train_dir: Path  # train artifact
    encoded_dir: Path  # encode artifact
    cache_root: Path  # holds the sample store the encode artifact points into
    base_model_digest: str
    encoded_digest: str
    lora_digest: str
    model_digests: dict[str, str] = field(default_factory=dict)  # the model's components: checked against the encoder's
    preprocess_dir: str = ""  # the preprocess artifact: its dataset.json says where edit pairs' images are
    datasets: dict = field(default_factory=dict)  # {"sources": the data.datasets they are in, as JSON}
