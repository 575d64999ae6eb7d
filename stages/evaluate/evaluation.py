"""The evaluate stage's work (torch, diffusers); `lorapipe.stages.evaluate.run` imports it when evaluate runs."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from lorapipe.cache.errors import UserError
from lorapipe.cache.store import Built
from lorapipe.stages import families
from lorapipe.stages.contract import Log
from lorapipe.stages.encoded import EncodedData, Sample
from lorapipe.stages.families import ObjectiveParams
from lorapipe.stages.families.folders import found_index
from lorapipe.stages.families.modular import load_render_pipeline
from lorapipe.stages.lora_formats.diffusers_format import add_adapter_from_file, adapter_kind, recorded_adapter
from lorapipe.stages.lora_formats.lora_folder import EMA_DIR, LORA_FILE, TRAIN_CONFIG, checkpoint_loras, expert_file
from lorapipe.stages.sources.inventory import stored_dtype

from .clip import clip_score, load_clip
from .edits import EditPair, held_out_pairs, pixel_distances, render_pairs, write_edit_grid
from .fid import fid_kid
from .losses import LossResult, Scoring, denoising_loss, loss_subset
from .merged_losses import merged
from .params import (CHECKPOINT_CHART, CHECKPOINT_LOSSES, EDIT_GRID, GRID, METRICS, REPORT, VERSION, EvalInputs,
                     EvalOptions, EvalParams)
from .render import Clip, RenderSettings, compose_grid, first_frames, render_column, render_size_kwargs, write_clips
from .report import plot_checkpoint_losses, write_report

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

LORA_ADAPTER = "lora"
EMA_ADAPTER = "ema"  # the EMA of the trained adapter, when train.ema_decay was set
COLUMN = {LORA_ADAPTER: "LoRA", EMA_ADAPTER: "EMA"}  # the grid's column label of each adapter
SPLITS = ("holdout", "train")


@dataclass(frozen=True)
class LossSamples:
    """What the denoising losses are scored on: per split the subject's samples (a prior dataset's
    images, train.prior_loss_weight, are not what the LoRA learns) and the subset scored, at the
    timesteps the trained denoiser works at."""

    encoded: EncodedData
    in_split: dict[str, list[Sample]]
    scored: dict[str, list[Sample]]  # evaluate.loss_samples of each split, drawn by loss_seed
    timesteps: list[int]
    seed: int

    @classmethod
    def of(cls, encoded: EncodedData, params: EvalParams, timesteps: list[int]) -> "LossSamples":
        in_split = {name: [s for s in encoded.split(name) if s.role == "train"] for name in SPLITS}
        return cls(encoded, in_split, {name: loss_subset(samples, params.loss_samples, params.loss_seed)
                                       for name, samples in in_split.items()}, timesteps, params.loss_seed)

    def losses(self, denoiser: torch.nn.Module, scoring: Scoring,
               splits: dict[str, list[Sample]] | None = None) -> dict[str, LossResult]:
        """Denoising loss of the pipeline's denoiser, as it is now, on every non-empty split (default: `scored`)."""
        return {name: denoising_loss(denoiser, scoring, self.encoded, samples, self.timesteps, self.seed)
                for name, samples in (self.scored if splits is None else splits).items() if samples}

    def counts(self) -> dict[str, dict[str, int]]:
        return {"n_samples": {name: len(samples) for name, samples in self.scored.items()},  # scored for the loss
                "n_samples_in_split": {name: len(samples) for name, samples in self.in_split.items()}}


@dataclass(frozen=True)
class TrainedDenoiser:
    """One trained denoiser: its name ('' for a run's one denoiser), its family bound to it, the base
    model's and the LoRA's scorings, and the samples scored at the timesteps of its range."""

    name: str
    family: families.Family
    scoring: dict[str, Scoring]
    samples: LossSamples

    def lora_file(self, folder: Path) -> Path:
        return Path(folder) / expert_file(LORA_FILE, self.name)


def scored_losses(denoisers: list[TrainedDenoiser], pipe: DiffusionPipeline, scoring: str,
                  splits: dict[str, list[Sample]] | None = None) -> dict[str, LossResult]:
    """Per split, the loss of the pipeline's trained denoisers as they are now, scored as `scoring`
    (base or lora) says, merged (merged_losses)."""
    return merged({d.name: d.samples.losses(getattr(pipe, d.family.components.denoiser), d.scoring[scoring], splits)
                   for d in denoisers})


def run(
    params: EvalParams, inputs: EvalInputs, out_dir: Path, work_dir: Path,
    options: EvalOptions = EvalOptions(), log: Log = print,
) -> Built:
    """Write the evaluation of inputs.train_dir's LoRA into out_dir (work_dir is not needed)."""
    choice = _trained_params(inputs.train_dir).get("denoiser")
    trained = _bound(families.for_model(inputs.model_path), choice)
    family, bound = trained
    _check_lora_files(inputs.train_dir, bound)
    encoded = EncodedData(inputs.encoded_dir, inputs.cache_root)
    encoded.check_model(inputs.model_path, family.name, inputs.model_digests)
    denoisers = _trained_denoisers(bound, choice, encoded, params, inputs)
    samples = denoisers[0].samples  # every denoiser scores the same samples
    (render_family, render_bound), render_path = _renderer(trained, inputs, params, choice)
    pairs = held_out_pairs(encoded, inputs.preprocess_dir, inputs.datasets, params.edit_pairs, params.loss_seed)
    fps = _clip_fps(params, encoded, render_family)
    settings = _render_settings(render_family, render_path, encoded, params, options,  # bad settings: before loading
                                _prompt_references(render_family, pairs), fps)
    columns = None
    if render_path != inputs.model_path:  # rendered first and released, so one pipeline is in memory at a time
        columns = _render_grid(_load_pipeline(render_path, render_family, options), render_family, render_bound,
                               render_path, settings, params, inputs.train_dir, log)
    pipe = _load_pipeline(inputs.model_path, family, options)

    log(f"evaluate: base model, {len(samples.scored['holdout'])} held-out losses")
    base = scored_losses(denoisers, pipe, "base")
    if columns is None:
        columns = _render_grid(pipe, family, bound, inputs.model_path, settings, params, inputs.train_dir, log)
    else:
        _load_adapters(pipe, bound, inputs.train_dir)
    adapters = {}
    for name in _adapter_files(inputs.train_dir, bound):
        pipe.set_adapters([name], adapter_weights=[1.0])
        adapters[name] = scored_losses(denoisers, pipe, "lora")

    edits = (_render_edits(pipe, family, bound, pairs, params, settings, inputs.train_dir, out_dir, log)
             if pairs else None)
    rows = [(prompt, seed) for prompt in params.prompts for seed in params.seeds]
    stills = first_frames(columns)
    compose_grid(stills, rows, params.resolution).save(out_dir / GRID)
    clips = write_clips(columns, rows, params.resolution, fps, out_dir)
    metrics = {
        "loss": _loss_table(base, adapters),
        "clip_score": _clip_metrics(params, stills, [prompt for prompt, _ in rows], pipe.device, log),
        "fid_kid": _fid_metrics(params, stills, log), **samples.counts(),
        "prediction_type": {name: s.objective.prediction for name, s in denoisers[0].scoring.items()},
        "provenance": {"base_model": inputs.base_model_digest, "encoded": inputs.encoded_digest,
                       "lora": inputs.lora_digest, "evaluate_version": VERSION},
        **({"clips": clips, "clip_fps": fps} if clips else {}),  # the animated grid and one mp4 per clip (video models)
        **({"edit": edits} if edits else {}),  # held-out edit pairs (edit models)
    }
    _write_json(out_dir / METRICS, metrics)
    checkpoints = _checkpoint_losses(pipe, denoisers, inputs.train_dir, base)
    _write_checkpoint_losses(out_dir, checkpoints)
    write_report(out_dir / REPORT, metrics, sorted(t for d in denoisers for t in d.samples.timesteps), checkpoints)
    return Built(info=_headline(metrics))


def _loss_table(base: dict[str, LossResult], adapters: dict[str, dict[str, LossResult]]) -> dict[str, Any]:
    """metrics.json's `loss`: per split the base model's and each adapter's, or why it was skipped."""
    return {name: {"base": base[name], **{adapter: scored[name] for adapter, scored in adapters.items()}}
            if name in base else {"skipped": f"the {name} split is empty"}
            for name in SPLITS}


def _trained_params(train_dir: Path) -> dict[str, Any]:
    """The train settings train_config.json records ({} without one)."""
    config = Path(train_dir) / TRAIN_CONFIG
    return json.loads(config.read_text()).get("params", {}) if config.is_file() else {}


def _bound(model: families.Family, choice: str | None) -> tuple[families.Family, dict[str, families.Family]]:
    """The family that renders (bound to the trained denoiser; the model as a whole where train.denoiser
    trained several) and each trained denoiser's family, by name (Family.trained_denoisers)."""
    bound = model.trained_denoisers(choice)
    return bound.get("", model), bound


def _check_lora_files(train_dir: Path, bound: dict[str, families.Family]) -> None:
    for name in bound:
        file = expert_file(LORA_FILE, name)
        if not (Path(train_dir) / file).is_file():
            raise FileNotFoundError(f"{train_dir} has no {file}: it is not a train artifact; re-run train")


def _trained_denoisers(bound: dict[str, families.Family], choice: str | None, encoded: EncodedData,
                       params: EvalParams, inputs: EvalInputs) -> list[TrainedDenoiser]:
    """Each trained denoiser with its scorings and the samples scored at the timesteps of its range."""
    found = []
    for name, family in bound.items():
        scoring = _scorings(family, inputs.model_path, inputs.train_dir)
        steps = _loss_timesteps(scoring["lora"], params, name or choice)
        found.append(TrainedDenoiser(name, family, scoring, LossSamples.of(encoded, params, steps)))
    return found


def _loss_timesteps(scoring: Scoring, params: EvalParams, denoiser: str | None) -> list[int]:
    """evaluate.loss_timesteps at which the trained denoiser works (all of them, for a model with one)."""
    steps = scoring.objective.steps_scored(list(params.loss_timesteps))
    if not steps:
        raise UserError(f"evaluate.loss_timesteps: the trained denoiser ({denoiser}) works at none of"
                        f" {list(params.loss_timesteps)}; add timesteps of its range")
    return steps


def _scorings(family: families.Family, model_path: Path, train_dir: Path) -> dict[str, Scoring]:
    """The base model scored as it predicts, the LoRA as it was trained (train_config.json's objective
    settings: a LoRA trained to predict v against v), both conditioned as training was."""
    recorded = _trained_params(train_dir)
    trained = ObjectiveParams(**{k: v for k, v in recorded.items() if k in ObjectiveParams.model_fields})
    base = trained.model_copy(update={"prediction_type": None})
    return {"base": Scoring(family, family.objective(model_path, base), trained),
            "lora": Scoring(family, family.objective(model_path, trained), trained)}


def _renderer(trained: tuple[families.Family, dict[str, families.Family]], inputs: EvalInputs, params: EvalParams,
              denoiser: str | None) -> tuple[tuple[families.Family, dict[str, families.Family]], Path]:
    """The families (_bound: bound to its variant and the trained denoisers) and folder of the model
    that renders the grid: evaluate.render_model, else the training model (`trained`)."""
    if params.render_model is None:
        return trained, inputs.model_path
    family = trained[0]
    path = Path(params.render_model)
    if found_index(path) is None:
        raise UserError(f"evaluate.render_model: {path} is not a diffusers model folder (no model_index.json)")
    renderer, bound = _bound(families.for_model(path), denoiser)
    if renderer.name != family.name:
        raise UserError(f"evaluate.render_model: {path} is a {renderer.label} model, but the LoRA is trained on"
                        f" {family.label} ({inputs.model_path}); give a checkpoint of the same family")
    return (renderer, bound), path


def _adapter_files(train_dir: Path, bound: dict[str, families.Family]) -> dict[str, dict[str, Path]]:
    """The train artifact's adapters (the trained one, and its EMA when the run kept one): the file
    of each trained denoiser, by its name."""
    folders = {LORA_ADAPTER: Path(train_dir), EMA_ADAPTER: Path(train_dir) / EMA_DIR}
    files = {adapter: {name: folder / expert_file(LORA_FILE, name) for name in bound}
             for adapter, folder in folders.items()}
    return {adapter: by_name for adapter, by_name in files.items() if all(f.is_file() for f in by_name.values())}


def _load_adapter(pipe: DiffusionPipeline, family: families.Family, file: Path, name: str) -> None:
    """A LoRA or DoRA file through diffusers' own loader (as a user loads it); LoKr and LoHa, which it
    refuses, through peft with the config the file records."""
    prefix = family.components.adapter_prefix()
    if adapter_kind(recorded_adapter(file, prefix)) in ("lora", "dora"):
        pipe.load_lora_weights(file.parent, weight_name=file.name, adapter_name=name,
                               **dict(family.components.lora_load_kwargs))
    else:
        add_adapter_from_file(getattr(pipe, family.components.denoiser), file, prefix, name)


def _load_adapters(pipe: DiffusionPipeline, bound: dict[str, families.Family],
                   train_dir: Path) -> dict[str, dict[str, Path]]:
    """Each adapter into each trained denoiser, under the adapter's name (one per denoiser module)."""
    files = _adapter_files(train_dir, bound)
    for adapter, by_name in files.items():
        for name, file in by_name.items():
            _load_adapter(pipe, bound[name], file, adapter)
    return files


def _render_grid(pipe: DiffusionPipeline, family: families.Family, bound: dict[str, families.Family],
                 model_path: Path, settings: RenderSettings, params: EvalParams, train_dir: Path,
                 log: Log) -> dict[str, list[Clip]]:
    """The grid's columns: `pipe` without the LoRA, then with it at each scale, then its EMA at each
    scale when there is one (the adapters stay loaded)."""
    sampler = params.scheduler or family.sampler
    scoring = _scorings(family, model_path, train_dir)  # a LoRA trained to predict v is sampled as v
    log(f"evaluate: {family.label} {model_path.name} renders {len(params.prompts) * len(params.seeds)} samples"
        f" per column, {settings.num_inference_steps} steps, {torch.get_num_threads()} torch threads")
    family.prepare_pipeline(pipe, sampler, scoring["base"].objective)
    columns = {"base": render_column(pipe, settings)}
    family.prepare_pipeline(pipe, sampler, scoring["lora"].objective)
    for name in _load_adapters(pipe, bound, train_dir):
        for scale in params.lora_scales:
            log(f"evaluate: {COLUMN[name]} at scale {scale:g}")
            pipe.set_adapters([name], adapter_weights=[scale])
            columns[f"{COLUMN[name]} x{scale:g}"] = render_column(pipe, settings)
    return columns


def _render_edits(pipe: DiffusionPipeline, family: families.Family, bound: dict[str, families.Family],
                  pairs: list[EditPair], params: EvalParams, settings: RenderSettings, train_dir: Path,
                  out_dir: Path, log: Log) -> dict[str, Any]:
    """edit_grid.png of the held-out pairs, by the base model and the adapters at each scale (they
    are loaded), and each column's distance to the targets."""
    seeds = list(params.seeds)
    log(f"evaluate: {len(pairs)} held-out edit pairs, {len(seeds)} seeds per column")

    def render() -> list[Image.Image]:
        return render_pairs(pipe, family, pairs, seeds, settings.num_inference_steps, settings.family_kwargs)

    pipe.disable_lora()
    rendered = {"base": render()}
    pipe.enable_lora()
    for name in _adapter_files(train_dir, bound):
        for scale in params.lora_scales:
            pipe.set_adapters([name], adapter_weights=[scale])
            rendered[f"{COLUMN[name]} x{scale:g}"] = render()
    write_edit_grid(out_dir / EDIT_GRID, pairs, seeds, rendered, params.resolution)
    return {"pairs": len(pairs), "pixel_mse_to_target": pixel_distances(pairs, seeds, rendered)}


def _prompt_references(family: families.Family, pairs: list[EditPair]) -> dict[str, Any]:
    """The pipeline arguments the prompt grid renders with: none, or for a pipeline that only edits,
    the first held-out pair's references (the prompts edit them)."""
    if family.renders_without_references:
        return {}
    if not pairs:
        raise UserError(f"evaluate: {family.label} renders edits of reference images, and no held-out sample has"
                        " references: hold out edit pairs (preprocess.holdout_fraction, evaluate.edit_pairs)")
    return family.reference_render_kwargs(pairs[0].references)


def _clip_fps(params: EvalParams, encoded: EncodedData, family: families.Family) -> float:
    """The frame rate clips render and play at: evaluate.fps, else the rate the training clips were
    sampled at (so a LoRA plays at the speed it learned), else the model's own (trained on stills)."""
    if params.fps is not None:
        return params.fps
    sampled = Counter(s.fps for s in encoded.samples if s.fps).most_common(1)
    return sampled[0][0] if sampled else float(family.clip_fps)


def _render_settings(family: families.Family, model_path: Path, encoded: EncodedData, params: EvalParams,
                     options: EvalOptions, references: dict[str, Any], fps: float) -> RenderSettings:
    """The prompts rendered as the model renders them (the family's defaults for what is unset),
    with the text settings the records were encoded with (Flux.1's T5 length), clips at `fps`;
    `references`: the reference images a pipeline that only edits is given."""
    multiple = family.geometry(model_path).pixel_multiple
    if params.resolution % multiple:
        raise UserError(f"evaluate.resolution: {family.label} renders sides that are multiples of {multiple} px,"
                        f" not {params.resolution}")
    guidance = family.variant.render_guidance if params.guidance_scale is None else params.guidance_scale
    text = family.text_settings(model_path, encoded.text_options)
    try:
        clip = family.clip_kwargs(model_path, params.num_frames, fps)
    except ValueError as problem:
        raise UserError(str(problem)) from None
    return RenderSettings(list(params.prompts), list(params.seeds),
                          params.num_inference_steps or family.variant.render_steps, params.resolution,
                          options.render_batch_size,
                          {**family.render_kwargs(text, guidance, params.negative_prompt), **clip, **references,
                           **render_size_kwargs(family, params.resolution, params.resolution)})


def _load_pipeline(model_path: Path, family: families.Family, options: EvalOptions) -> DiffusionPipeline:
    """The model's pipeline, its text encoders and VAE in the dtype each is stored in, every other
    component in the dtype its denoiser is stored in: unasked, diffusers loads its models in float32 (a
    model stored in bf16, as the published ones are, would then not run beside its text encoders), a
    text encoder cast to a float32 denoiser's dtype can be twice its stored size (UMT5-XXL: 21 GiB in
    float32), and a VAE stored in float32 beside a bf16 denoiser (as Wan's, which its pipeline's
    examples load in float32) decodes as stored."""
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    components = family.components
    stored = {name: getattr(torch, dtype) for name in (*components.text, *components.latent, components.denoiser)
              if (dtype := stored_dtype(model_path / name))}
    if components.denoiser in stored:  # the rest in its dtype (unread, e.g. fp8: as diffusers loads them)
        stored["default"] = stored.pop(components.denoiser)
    return load_render_pipeline(model_path, family, stored, device)


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
    return {"base": scores.pop("base"), **{
        name: {str(float(s)): scores[f"{label} x{s:g}"] for s in params.lora_scales}
        for name, label in COLUMN.items() if f"{label} x{params.lora_scales[0]:g}" in scores}}


def _fid_metrics(params: EvalParams, columns: dict[str, list[Image.Image]], log: Log) -> dict[str, Any]:
    result = fid_kid(params.fid_reference, params.inception_weights, columns)
    if "skipped" in result:
        log(f"evaluate: FID/KID skipped: {result['skipped']}")
    return result


def _checkpoint_losses(
    pipe: DiffusionPipeline, denoisers: list[TrainedDenoiser], train_dir: Path, base: dict[str, LossResult],
) -> dict[str, Any] | None:
    """Held-out loss of every retained checkpoint's LoRA (its file for each trained denoiser); None
    when the train artifact has none."""
    found = {d.name: dict(checkpoint_loras(train_dir, d.lora_file(train_dir).name)) for d in denoisers}
    steps = sorted(set.intersection(*(set(files) for files in found.values())))
    if not steps:
        return None
    holdout = denoisers[0].samples.scored["holdout"]
    if not holdout:
        return {"skipped": "the holdout split is empty"}
    results = []
    for step in steps:  # one checkpoint at a time: unloading restores the base denoisers
        pipe.unload_lora_weights()
        for d in denoisers:
            _load_adapter(pipe, d.family, found[d.name][step], LORA_ADAPTER)
        loss = scored_losses(denoisers, pipe, "lora", {"holdout": holdout})["holdout"]
        results.append({"step": step, **loss})
    return {"split": "holdout", "base": base["holdout"]["overall"], "checkpoints": results}


def _write_checkpoint_losses(out_dir: Path, checkpoints: dict[str, Any] | None) -> None:
    """checkpoint_losses.json and its chart, where the train artifact has checkpoints."""
    if checkpoints is not None:
        _write_json(out_dir / CHECKPOINT_LOSSES, checkpoints)
        if "skipped" not in checkpoints:
            plot_checkpoint_losses(out_dir / CHECKPOINT_CHART, checkpoints)


def _headline(metrics: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {"n_samples": metrics["n_samples"]}
    for split, result in metrics["loss"].items():
        for model in ("base", LORA_ADAPTER, EMA_ADAPTER):
            if model in result:
                info[f"{split}_loss_{model}"] = result[model]["overall"]
    clip = metrics["clip_score"]
    if "skipped" not in clip:
        info["clip_score_base"] = clip["base"]
        info["clip_score_lora"] = clip["lora"]
        if EMA_ADAPTER in clip:
            info["clip_score_ema"] = clip[EMA_ADAPTER]
    return info


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, sort_keys=True, indent=2) + "\n")
