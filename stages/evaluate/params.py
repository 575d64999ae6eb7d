"""The evaluate stage's settings and inputs. Imports nothing heavy: flows load this to build keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from lorapipe.stages.contract import Frozen, JsonInputs
from lorapipe.stages.train.checkpoints import LORA_FILE

VERSION = "2"  # 2: fixed noise and loss subset seeded by content, not file name
LORA_WEIGHTS = LORA_FILE  # what the train stage writes
LOCAL_PATHS = ("clip_model", "fid_reference", "inception_weights", "render_model")  # keyed by content, not path


class EvalParams(Frozen):
    """Every setting that changes evaluate's output."""

    prompts: tuple[str, ...] = Field(min_length=1)
    seeds: tuple[int, ...] = Field((0, 1), min_length=1)
    lora_scales: tuple[float, ...] = Field((1.0,), min_length=1)  # base is always shown as well
    num_inference_steps: int | None = Field(None, ge=1, description="None: the rendering model's (SD 20, Flux.1 dev"
                                            " 28, schnell 4, Z-Image Turbo 9)")
    guidance_scale: float | None = Field(None, description="None: the rendering model's (SD 5.0, Flux.1 dev 3.5,"
                                         " schnell 0, Z-Image Turbo 0)")
    negative_prompt: str = ""
    resolution: int = Field(64, gt=0, multiple_of=8)
    num_frames: int | None = Field(None, ge=1, description="frames of each rendered clip (video models);"
                                   " None: the model's default")
    scheduler: Literal["dpm_solver_multistep", "ddim", "euler", "flow_match_euler", "flow_unipc"] | None = Field(
        None, description="None: the model's (SD dpm_solver_multistep; flow-matching models flow_match_euler)")
    loss_timesteps: tuple[int, ...] = Field((100, 300, 500, 700, 900), min_length=1)
    loss_seed: int = 0
    loss_samples: int | None = Field(256, ge=1)  # per split; None: every sample (cost grows with the data)
    clip_model: str | None = None  # a local CLIP folder; without one the CLIP score is skipped
    fid_reference: str | None = None  # a folder of reference images for FID/KID
    inception_weights: str | None = None  # local Inception-v3 weights; without them FID/KID are skipped
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

    render_batch_size: int = Field(1, ge=1)
    device: str | None = None  # None: cuda when available, else cpu
    cpu_threads: int | None = Field(None, gt=0, description="torch threads of the evaluation; default: the config's"
                                    " cpu_threads (stages/cpu_threads.py)")


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
