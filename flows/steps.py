"""The pipeline's stages (PIPELINE, the DAG in one table; caption only where configured), what each
stage's key is made of and how it is built, given the artifacts of the stages it reads.

Each `*_step` returns a Step: its StageKey (stage, VERSION, params, input artifact digests,
model component digests, library majors — never paths, run ids or the whole config) and a
build function for the cache store. Computing keys is cheap: it hashes only changed files.
"""
from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Callable, Mapping

from lorapipe.cache.digest import StatCache, digest_tree, path_identity
from lorapipe.cache.errors import UserError
from lorapipe.cache.object_store import ObjectSettings, open_store
from lorapipe.cache.objects import is_url, use_storage_options
from lorapipe.cache.store import Artifact, Built, StageKey
from lorapipe.stages import caption, encode, evaluate, families, preprocess, train
from lorapipe.stages.contract import KEYED_LIBRARIES, Log, library_majors, library_versions
from lorapipe.stages.models import component_digests, weights_digest
from lorapipe.stages.processes.placement import Placement, Where
from lorapipe.stages.sources import compose
from lorapipe.stages.sources.model_source import BaseModel, resolve_base

from .config import PipelineConfig, split


@dataclass(frozen=True)
class Step:
    key: StageKey
    build: Callable[[Path, Path], Built | None]
    follow: Callable[[Path], None] | None = None  # train on machine rank > 0: join rank 0's build (a private work dir)


def pinned(config: PipelineConfig) -> PipelineConfig:
    """`config` with a Hugging Face repo's revision resolved, once per run, to the commit it names
    now: every Context of the run (its plan, each stage, a sweep's variants) then reads that
    commit, even if the branch moves meanwhile. A local model is left as it is."""
    if isinstance(config.model.path, Path):
        return config
    source = resolve_base(config.model.path, config.model.revision).source
    return config.model_copy(update={"model": config.model.pinned(source.commit, source.revision)})


class Context:
    """Per-run facts shared by the steps: the store, the stat cache, the model's identity."""

    def __init__(self, config: PipelineConfig, log: Log = print, reads_only: bool = False,
                 placements: Mapping[str, Placement] | None = None):
        """reads_only: for a command that writes nothing in the cache (status): a cache folder this
        process may not write (a read-only filesystem, no permission) is read as it is.
        placements: where each stage's job runs (the run's plan, flows/run_plan.py); a stage
        missing there runs where its own settings say."""
        self.config, self.log = config, log
        self.placements = placements or {}
        use_storage_options(config.storage_options)  # for this process and the stages' child processes
        self.store = open_store(config.cache_dir, object_settings(config), log)
        read_only = reads_only and not self.store.writable()
        if not read_only:
            self.store.ensure_usable()
        self.stat_cache = StatCache(self.store.root / "stat-cache.sqlite", read_only)  # on this host, for an object store

    @cached_property
    def base(self) -> BaseModel:
        """model.path as local files (a Hugging Face repo: its snapshot, fetched once), and where they came from."""
        base = resolve_base(self.config.model.path, self.config.model.revision)
        if base.source.kind == "hub":
            self.log(f"model: {base.source} ({base.path})")
        return base

    @cached_property
    def declared_family(self) -> families.Family:
        """The model's family, from its folder's index or a single file's tensor names (or model.family)."""
        return families.for_model(self.base.path, self.config.model.family)

    @cached_property
    def base_digests(self) -> dict[str, str]:
        """The base model's component digests (model.path's)."""
        return component_digests(self.base.path, self.stat_cache, self.declared_family)

    @property
    def models_root(self) -> Path:
        """Where model folders made from the user's files are kept: converted checkpoints, composed models."""
        return self.store.root / "models"

    @cached_property
    def converted_base(self) -> Path:
        """Where a single-file base's diffusers folder is (made by base_folder, once): `<models>/<its identity>`."""
        return self.models_root / self.declared_family.components.identity(self.base_digests)

    @cached_property
    def base_folder(self) -> Path:
        """The base as a diffusers folder: model.path (a repo's snapshot), or its single-file checkpoint
        converted once into the cache (converted_base)."""
        path = self.base.path
        if not families.is_single_file(path):
            return path
        converted = self.converted_base
        return families.single_file_folder(self.declared_family, path, converted.name, converted.parent)

    @cached_property
    def base_family(self) -> families.Family:
        """The family bound to the base's variant (read from its diffusers folder's configs)."""
        return families.for_model(self.base_folder, self.declared_family.name)

    @cached_property
    def components(self) -> dict[str, Path]:
        """The components set over the base (model.transformer, model.vae, model.text_encoders, ...)."""
        model = self.config.model
        if not model.components and not model.text_encoders:
            return {}
        return compose.components_over(self.base_family, self.base_folder, model.components, model.text_encoders)

    @cached_property
    def model_digests(self) -> dict[str, str]:
        """Every component's digest: the base's, but each component set over it by its own content."""
        return {**self.base_digests, **{name: weights_digest(path, self.stat_cache)
                                        for name, path in self.components.items()}}

    @cached_property
    def identity(self) -> str:
        """The model's identity (its denoiser's digest): what a LoRA is made for."""
        return self.declared_family.components.identity(self.model_digests)

    @cached_property
    def model_path(self) -> Path:
        """A diffusers folder: the base's, or one composed once in the cache with the components set
        over it (stages/sources/compose.py)."""
        if not self.components:
            return self.base_folder
        return compose.composed_folder(self.base_family, self.base_folder, self.components, self.model_digests,
                                       self.models_root, self.log)

    @cached_property
    def family(self) -> families.Family:
        """The family bound to the model's variant (read from the diffusers folder's configs)."""
        return families.for_model(self.model_path, self.declared_family.name)

    def models_for(self, stage: str) -> dict[str, str]:
        parts = self.declared_family.components.for_stage(stage)
        return {k: v for k, v in self.model_digests.items() if k in parts}

    def stage_key(self, stage: str, params, inputs: dict[str, str], resumable: tuple[str, ...] = (),
                  resolved: dict | None = None) -> StageKey:
        """`resolved`: what the family derives from the params and the model (encode's text settings)."""
        ingredients = {
            "stage": stage, "version": PIPELINE[stage].module.VERSION, "params": params.model_dump(mode="json"),
            "inputs": inputs, "models": self.models_for(stage), "libs": library_majors(*KEYED_LIBRARIES),
        }
        return StageKey(stage, {**ingredients, "resolved": resolved} if resolved else ingredients, resumable)

    def producer(self, stage: str) -> dict:
        """Provenance recorded in the manifest, not keyed: exact versions and the code's digest."""
        return {"libs": library_versions(*KEYED_LIBRARIES), "code": code_digest(stage), "pipeline": self.config.name}

    def close(self) -> None:
        self.stat_cache.close()


def object_settings(config: PipelineConfig) -> ObjectSettings | None:
    """How this host works with an object-storage cache_dir (None for a local folder)."""
    if not is_url(config.cache_dir):
        return None
    o = config.object_store
    return ObjectSettings(o.local_dir, int(o.shard_cache_gb * (1 << 30)), o.lease_seconds)


def code_digest(stage: str) -> str:
    module = PIPELINE[stage].module
    files = sorted(Path(module.__file__).parent.glob("*.py")) if module.__file__.endswith("__init__.py") \
        else [Path(inspect.getfile(module))]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def preprocess_step(ctx: Context) -> Step:
    cfg = ctx.config
    params = cfg.preprocess
    datasets = preprocess.dataset_ingredients(cfg.data.sources, params, ctx.stat_cache)
    # an edit model's bound on a target's references (a model that takes none refuses pairs at encode)
    limit = ctx.declared_family.max_references if any(d.pairs for d in cfg.data.sources) else 0
    conditioned = ctx.declared_family.image_condition is not None  # an image-to-video model's windows
    inputs = preprocess.PreprocessInputs(cfg.data.sources, ctx.stat_cache, limit or None, conditioned)
    resolved = {**({"max_references": limit} if limit else {}),
                **({"image_condition": True} if conditioned else {})} or None
    return Step(ctx.stage_key("preprocess", params, {"datasets": datasets}, resolved=resolved),
                lambda out, work: preprocess.run(params, inputs, out, work, None, ctx.log))


def caption_step(ctx: Context, pre: Artifact) -> Step:
    cfg = ctx.config
    params, options = split(cfg.caption, caption.CaptionParams, caption.CaptionOptions)
    model = cfg.caption.model
    if not model.is_dir():
        raise UserError(f"caption.model: {model} is not a folder (a transformers captioner: config.json and weights)")
    params = caption.resolved(params, model)
    captioner = digest_tree(model, ctx.stat_cache)  # its identity: its files, not its path
    inputs = caption.CaptionInputs(pre.path, cfg.data.sources, ctx.store.root, model, captioner, params.prompt)
    key = ctx.stage_key("caption", params, {"preprocess": pre.digest, "captioner": captioner,
                                            "policies": caption.policy_ingredients(cfg.data.sources)})
    return Step(key, lambda out, work: caption.run(params, inputs, out, work, options, ctx.log,
                                                   ctx.placements.get("caption")))


def encode_step(ctx: Context, dataset: Artifact) -> Step:
    """`dataset`: the caption artifact where configured, else preprocess's (keyed under "preprocess"
    either way, so configs without captions keep their keys)."""
    cfg = ctx.config
    params, options = split(cfg.encode, encode.EncodeParams, encode.EncodeOptions)

    def build(out: Path, work: Path) -> Built:
        inputs = encode.EncodeInputs(dataset.path, cfg.data.sources, ctx.store.root, ctx.model_path, ctx.family.name,
                                     ctx.models_for("encode"))
        return encode.run(params, inputs, out, work, options, ctx.log, ctx.placements.get("encode"))

    resolved = encode.resolved_settings(ctx.family, ctx.model_path, params)
    return Step(ctx.stage_key("encode", params, {"preprocess": dataset.digest}, resolved=resolved), build)


def train_step(ctx: Context, enc: Artifact) -> Step:
    cfg = ctx.config
    params, options = split(cfg.train, train.TrainParams, train.TrainOptions)
    if params.init_lora and not Path(params.init_lora).is_file():
        raise UserError(f"train.init_lora: {params.init_lora} is not a file")
    init_lora = ctx.stat_cache.digest(Path(params.init_lora)) if params.init_lora else "none"
    keyed = params.model_copy(update={"init_lora": None})  # keyed by its content (inputs), not its path
    key = ctx.stage_key("train", keyed, {"encode": enc.digest, "init_lora": init_lora},
                        resumable=("params.max_steps",))

    def inputs() -> train.TrainInputs:
        return train.TrainInputs(
            encoded_dir=enc.path, cache_root=ctx.store.root, model_path=ctx.model_path, base_model_digest=ctx.identity,
            encoded_digest=enc.digest, init_lora_digest=init_lora, model_digests=ctx.model_digests,
        )

    placement = ctx.placements.get("train")
    return Step(key, lambda out, work: train.run(params, inputs(), out, work, options, ctx.log, placement),
                lambda work: train.follow(params, inputs(), work, options, ctx.log, placement))


def evaluate_step(ctx: Context, pre: Artifact, enc: Artifact, trained: Artifact) -> Step:
    cfg = ctx.config
    params, options = split(cfg.evaluate, evaluate.EvalParams, evaluate.EvalOptions)
    local = {name: path_identity(getattr(params, name), ctx.stat_cache)  # their contents, not their paths
             for name in evaluate.LOCAL_PATHS}
    keyed = params.model_copy(update=dict.fromkeys(local))
    key = ctx.stage_key("evaluate", keyed, {"encode": enc.digest, "train": trained.digest, **local})

    def build(out: Path, work: Path) -> Built:
        inputs = evaluate.EvalInputs(
            model_path=ctx.model_path, train_dir=trained.path, encoded_dir=enc.path, cache_root=ctx.store.root,
            base_model_digest=ctx.identity, encoded_digest=enc.digest, lora_digest=trained.digest,
            preprocess_dir=str(pre.path), datasets={"sources": [d.model_dump(mode="json") for d in cfg.data.sources]},
        )
        return evaluate.run(params, inputs, out, work, options, ctx.log, ctx.placements.get("evaluate"))

    return Step(key, build)


@dataclass(frozen=True)
class StageDef:
    """A stage of the pipeline: its module (VERSION, run; its code's digest), the step that keys and
    builds it from the artifacts of the stages it reads, and, for a stage whose work is a job
    (stages/processes/jobs.py), where its settings say the job runs (stages/processes/placement.py)."""

    module: ModuleType
    step: Callable[..., Step]  # (ctx, *the artifacts of `reads`, in order) -> Step
    reads: tuple[str, ...] = ()
    where: Callable[[PipelineConfig], Where] | None = None
    # an optional stage: whether a config runs it, and the stage whose artifact its readers read when it does not
    configured: Callable[[PipelineConfig], bool] | None = None
    absent_reads: str | None = None


PIPELINE = {  # preprocess -> [caption] -> encode -> train -> evaluate
    "preprocess": StageDef(preprocess, preprocess_step),
    "caption": StageDef(caption, caption_step, ("preprocess",),
                        lambda cfg: caption.where(*split(cfg.caption, caption.CaptionParams, caption.CaptionOptions)),
                        configured=lambda cfg: cfg.caption is not None, absent_reads="preprocess"),
    "encode": StageDef(encode, encode_step, ("caption",),
                       lambda cfg: encode.where(split(cfg.encode, encode.EncodeParams, encode.EncodeOptions)[1])),
    "train": StageDef(train, train_step, ("encode",),
                      lambda cfg: train.where(*split(cfg.train, train.TrainParams, train.TrainOptions))),
    "evaluate": StageDef(evaluate, evaluate_step, ("caption", "encode", "train"),
                         lambda cfg: evaluate.where(split(cfg.evaluate, evaluate.EvalParams, evaluate.EvalOptions)[1])),
}
ALL_STAGES = tuple(PIPELINE)
STAGES = tuple(name for name, defined in PIPELINE.items() if defined.configured is None)  # every config's


def config_stages(config: PipelineConfig) -> tuple[str, ...]:
    """The stages `config` runs, in order: every config's and the optional ones it configures."""
    return tuple(name for name, defined in PIPELINE.items() if defined.configured is None or defined.configured(config))


def reads_of(stage: str, config: PipelineConfig) -> tuple[str, ...]:
    """The stages whose artifacts `stage` reads under `config` (an optional stage it does not run
    is read through: its readers read what it would have read)."""
    absent = {name: PIPELINE[name].absent_reads for name in PIPELINE if name not in config_stages(config)}
    return tuple(absent.get(name, name) for name in PIPELINE[stage].reads)


def step_for(stage: str, ctx: Context, upstream: dict[str, Artifact]) -> Step:
    """`stage`'s Step, given (at least) the artifacts of the stages it reads."""
    return PIPELINE[stage].step(ctx, *(upstream[name] for name in reads_of(stage, ctx.config)))
