"""Evaluate: sample grid (base vs LoRA), denoising loss on held-out and train data, CLIP score.

Reads:  the base model folder; the train artifact (`pytorch_lora_weights.safetensors`, and
        `checkpoints/step-N/pytorch_lora_weights.safetensors` for every retained checkpoint);
        the encode artifact and its sample store (cached latents and text embeddings).
Writes: grid.png, metrics.json, report.md; with checkpoints, checkpoint_losses.json and
        checkpoint_loss.png. All byte-deterministic for the same inputs and params.
Key:    VERSION, EvalParams, and the digests of the base model, encode and train artifacts; so
        changing a prompt, seed, scale, sampler or metric setting reruns evaluate only.

The pipeline is loaded once. Base images and base losses come first; then the LoRA is loaded as
an adapter and rendered at each scale. Losses use the LoRA at scale 1, the strength it was
trained at.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from PIL import Image
from pydantic import Field, field_validator

from cache.store import Built
from stages.contract import Frozen, Log
from stages.encoded import EncodedData, Sample
from stages.train.checkpoints import LORA_FILE

from .clip import clip_score, load_clip
from .fid import fid_kid
from .losses import LossResult, denoising_loss
from .render import RenderSettings, compose_grid, render_column, use_scheduler
from .report import plot_checkpoint_losses, write_report

if TYPE_CHECKING:
    from diffusers import DDPMScheduler, DiffusionPipeline

__all__ = ["VERSION", "EvalParams", "EvalOptions", "EvalInputs", "run", "LORA_WEIGHTS"]

VERSION = "1"
LORA_WEIGHTS = LORA_FILE  # what the train stage writes
LORA_ADAPTER = "lora"
SPLITS = ("holdout", "train")


class EvalParams(Frozen):
    """Every setting that changes evaluate's output."""

    prompts: tuple[str, ...] = Field(min_length=1)
    seeds: tuple[int, ...] = Field((0, 1), min_length=1)
    lora_scales: tuple[float, ...] = Field((1.0,), min_length=1)  # base is always shown as well
    num_inference_steps: int = Field(20, ge=1)
    guidance_scale: float = 5.0
    negative_prompt: str = ""
    resolution: int = Field(64, gt=0, multiple_of=8)
    scheduler: Literal["dpm_solver_multistep", "ddim", "euler"] = "dpm_solver_multistep"
    loss_timesteps: tuple[int, ...] = Field((100, 300, 500, 700, 900), min_length=1)
    loss_seed: int = 0
    clip_model: str | None = None  # a local CLIP folder; without one the CLIP score is skipped
    fid_reference: str | None = None  # a folder of reference images for FID/KID
    inception_weights: str | None = None  # local Inception-v3 weights; without them FID/KID are skipped

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


@dataclass(frozen=True)
class EvalInputs:
    model_path: Path  # diffusers-format model folder
    train_dir: Path  # train artifact
    encoded_dir: Path  # encode artifact
    cache_root: Path  # holds the sample store the encode artifact points into
    base_model_digest: str
    encoded_digest: str
    lora_digest: str


def run(
    params: EvalParams, inputs: EvalInputs, out_dir: Path, work_dir: Path,
    options: EvalOptions = EvalOptions(), log: Log = print,
) -> Built:
    """Write the evaluation of inputs.train_dir's LoRA into out_dir (work_dir is not needed)."""
    if not (Path(inputs.train_dir) / LORA_WEIGHTS).is_file():
        raise FileNotFoundError(f"{inputs.train_dir} has no {LORA_WEIGHTS}: it is not a train artifact; re-run train")
    encoded = EncodedData(inputs.encoded_dir, inputs.cache_root)
    splits = {name: encoded.split(name) for name in SPLITS}
    pipe, noise_scheduler = _load_pipeline(inputs.model_path, params, options)
    settings = RenderSettings(
        list(params.prompts), list(params.seeds), params.num_inference_steps, params.guidance_scale,
        params.negative_prompt, params.resolution, options.render_batch_size,
    )

    log(f"evaluate: base model, {len(params.prompts) * len(params.seeds)} images and losses")
    columns = {"base": render_column(pipe, settings)}
    base = _split_losses(pipe, noise_scheduler, encoded, splits, params)

    pipe.load_lora_weights(inputs.train_dir, weight_name=LORA_WEIGHTS, adapter_name=LORA_ADAPTER)
    prediction = {"base": noise_scheduler.config.prediction_type}
    prediction["lora"] = _trained_prediction_type(inputs.train_dir) or prediction["base"]
    for scheduler in (pipe.scheduler, noise_scheduler):  # a LoRA trained to predict v is sampled as v
        scheduler.register_to_config(prediction_type=prediction["lora"])
    for scale in params.lora_scales:
        log(f"evaluate: LoRA at scale {scale:g}")
        pipe.set_adapters([LORA_ADAPTER], adapter_weights=[scale])
        columns[f"LoRA x{scale:g}"] = render_column(pipe, settings)
    pipe.set_adapters([LORA_ADAPTER], adapter_weights=[1.0])
    lora = _split_losses(pipe, noise_scheduler, encoded, splits, params)

    rows = [(prompt, seed) for prompt in params.prompts for seed in params.seeds]
    compose_grid(columns, rows, params.resolution).save(out_dir / "grid.png")
    metrics = {
        "loss": {
            name: {"base": base[name], "lora": lora[name]} if name in base
            else {"skipped": f"the {name} split is empty"}
            for name in SPLITS
        },
        "clip_score": _clip_metrics(params, columns, [prompt for prompt, _ in rows], pipe.device, log),
        "fid_kid": _fid_metrics(params, columns, log),
        "n_samples": {name: len(samples) for name, samples in splits.items()},
        "prediction_type": prediction,
        "provenance": {
            "base_model": inputs.base_model_digest, "encoded": inputs.encoded_digest,
            "lora": inputs.lora_digest, "evaluate_version": VERSION,
        },
    }
    _write_json(out_dir / "metrics.json", metrics)
    checkpoints = _checkpoint_losses(pipe, noise_scheduler, inputs.train_dir, encoded, splits["holdout"], base, params)
    if checkpoints is not None:
        _write_json(out_dir / "checkpoint_losses.json", checkpoints)
        if "skipped" not in checkpoints:
            plot_checkpoint_losses(out_dir / "checkpoint_loss.png", checkpoints)
    write_report(out_dir / "report.md", metrics, list(params.loss_timesteps), checkpoints)
    return Built(info=_headline(metrics))


def _split_losses(
    pipe: DiffusionPipeline, noise_scheduler: DDPMScheduler, encoded: EncodedData,
    splits: dict[str, list[Sample]], params: EvalParams,
) -> dict[str, LossResult]:
    """Denoising loss of the pipeline's UNet, as it is now, on every non-empty split."""
    timesteps = list(params.loss_timesteps)
    return {
        name: denoising_loss(pipe.unet, noise_scheduler, encoded, samples, timesteps, params.loss_seed)
        for name, samples in splits.items() if samples
    }


def _load_pipeline(
    model_path: Path, params: EvalParams, options: EvalOptions
) -> tuple[DiffusionPipeline, DDPMScheduler]:
    """The pipeline with the sampler to render with, and the training noise schedule for losses."""
    from diffusers import DDPMScheduler, DiffusionPipeline

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe = DiffusionPipeline.from_pretrained(model_path).to(device)
    pipe.set_progress_bar_config(disable=True)
    noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    limit = noise_scheduler.config.num_train_timesteps
    if max(params.loss_timesteps) >= limit:
        raise ValueError(f"loss_timesteps must be below {limit}, the model's number of training timesteps")
    use_scheduler(pipe, params.scheduler)
    return pipe, noise_scheduler


def _trained_prediction_type(train_dir: Path) -> str | None:
    """The prediction type the LoRA was trained with, when training overrode the model's."""
    config = Path(train_dir) / "train_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("params", {}).get("prediction_type")


def _clip_metrics(
    params: EvalParams, columns: dict[str, list[Image.Image]], prompts: list[str], device: torch.device, log: Log
) -> dict[str, Any]:
    loaded = load_clip(params.clip_model) if params.clip_model else "no clip_model configured"
    if isinstance(loaded, str):
        log(f"evaluate: CLIP score skipped: {loaded}")
        return {"skipped": loaded}
    model, processor = loaded
    model.to(device)
    scores = {label: clip_score(model, processor, images, prompts) for label, images in columns.items()}
    return {
        "base": scores.pop("base"),
        "lora": {str(float(s)): scores[f"LoRA x{s:g}"] for s in params.lora_scales},
    }


def _fid_metrics(params: EvalParams, columns: dict[str, list[Image.Image]], log: Log) -> dict[str, Any]:
    result = fid_kid(params.fid_reference, params.inception_weights, columns)
    if "skipped" in result:
        log(f"evaluate: FID/KID skipped: {result['skipped']}")
    return result


def _checkpoint_losses(
    pipe: DiffusionPipeline, noise_scheduler: DDPMScheduler, train_dir: Path, encoded: EncodedData,
    holdout: list[Sample], base: dict[str, LossResult], params: EvalParams,
) -> dict[str, Any] | None:
    """Held-out loss of every retained checkpoint's LoRA; None when the train artifact has none."""
    found = sorted(
        (int(path.parent.name.removeprefix("step-")), path.parent)
        for path in (Path(train_dir) / "checkpoints").glob(f"step-*/{LORA_WEIGHTS}")
        if path.parent.name.removeprefix("step-").isdigit()
    )
    if not found:
        return None
    if not holdout:
        return {"skipped": "the holdout split is empty"}
    results = []
    for step, directory in found:  # one adapter at a time: unloading restores the base UNet
        pipe.unload_lora_weights()
        pipe.load_lora_weights(directory, weight_name=LORA_WEIGHTS, adapter_name=LORA_ADAPTER)
        loss = _split_losses(pipe, noise_scheduler, encoded, {"holdout": holdout}, params)["holdout"]
        results.append({"step": step, **loss})
    return {"split": "holdout", "base": base["holdout"]["overall"], "checkpoints": results}


def _headline(metrics: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {"n_samples": metrics["n_samples"]}
    for split, result in metrics["loss"].items():
        for model in ("base", "lora"):
            if model in result:
                info[f"{split}_loss_{model}"] = result[model]["overall"]
    clip = metrics["clip_score"]
    if "skipped" not in clip:
        info["clip_score_base"] = clip["base"]
        info["clip_score_lora"] = clip["lora"]
    return info


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, sort_keys=True, indent=2) + "\n")
