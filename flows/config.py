"""The pipeline config: YAML validated into frozen pydantic models, one section per stage.

A stage section holds the stage's keyed params and its unkeyed options side by side; `split`
separates them. Relative paths are resolved against the config file's folder.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import BeforeValidator, Field, ValidationError, ValidationInfo, field_serializer, field_validator, \
    model_validator, PrivateAttr

from lorapipe.cache.errors import CacheRootError, UserError
from lorapipe.cache.objects import bucket_and_prefix, is_url, local_path
from lorapipe.stages import families
from lorapipe.stages.caption import CaptionOptions, CaptionParams
from lorapipe.stages.encode import EncodeOptions, EncodeParams
from lorapipe.stages.evaluate import LOCAL_PATHS, EvalOptions, EvalParams
from lorapipe.stages.preprocess import DatasetSource, PreprocessParams
from lorapipe.stages.sources import hub
from lorapipe.stages.train import TrainOptions, TrainParams
from lorapipe.stages.contract import Frozen, PathOrUrl

SECRET_WORDS = ("secret", "token", "password", "passwd", "key", "credential", "sas", "connection_string",
                "signature")  # a storage option whose name holds one of these is a secret
MASK = "**********"


class ConfigError(UserError, ValueError):
    """A bad config: the message is one line naming the file and the key."""


def _path_or_repo_id(path: Any) -> Any:
    """A repo id stays a string; a path is a Path (load_config made every existing one absolute,
    and a missing one too unless it is shaped like a repo id)."""
    if isinstance(path, str) and not Path(path).is_absolute() and hub.is_repo_id(path):
        return path
    return Path(path) if isinstance(path, str) else path


PathOrRepoId = Annotated[Union[Path, str], BeforeValidator(_path_or_repo_id), "path or Hugging Face repo id"]
COMPONENT_KEYS = ("transformer", "transformer_2", "unet", "vae")  # model.<name>: that component over the base


class ModelConfig(Frozen):
    path: PathOrRepoId = Field(description="a diffusers-format model folder (model_index.json), a single-file"
                             " .safetensors checkpoint in the original layout (A1111/ComfyUI), or a Hugging Face"
                             " repo id (owner/name) of a diffusers model, fetched into the Hugging Face cache"
                             " (offline from there with HF_HUB_OFFLINE=1); a path that exists is local")
    revision: str | None = Field(None, description="a Hugging Face repo's branch, tag or commit (unset: main);"
                                 " only with a repo id")
    _configured_revision: str | None = PrivateAttr(None)  # set by `pinned`: the revision the user named

    family: str | None = Field(None, description=f"a single file's family ({', '.join(families.FAMILIES)}); unset:"
                               " detected from its tensor names (a folder's from model_index.json)")
    transformer: Path | None = Field(None, description="the denoiser over the base model.path (a community"
                                     " fine-tune): one .safetensors file in the original layout (BFL, Wan, LTX, with or"
                                     " without ComfyUI's prefix) or a diffusers component folder; the base supplies"
                                     " the rest (docs/families.md)")
    transformer_2: Path | None = Field(None, description="Wan 2.2 A14B's low-noise expert over the base, as"
                                       " model.transformer")
    unet: Path | None = Field(None, description="an SD1.x/SDXL UNet over the base, as model.transformer")
    vae: Path | None = Field(None, description="the VAE over the base: a .safetensors file or a diffusers component"
                             " folder; latents are encoded again, text records kept")
    text_encoders: dict[str, Path] | tuple[Path, ...] | None = Field(
        None, description="text encoders over the base, by their model_index.json names ({text_encoder: FILE,"
        " text_encoder_2: FILE}) or as a list in the family's order; each a .safetensors file or a diffusers"
        " component folder; text records are encoded again, latents kept")

    @property
    def components(self) -> dict[str, Path]:
        """The denoiser and VAE set over the base, by their model_index.json names (which is the key's name)."""
        return {name: getattr(self, name) for name in COMPONENT_KEYS if getattr(self, name) is not None}

    @field_validator("family")
    @classmethod
    def _registered(cls, family: str | None) -> str | None:
        if family is not None and family not in families.FAMILIES:
            raise ValueError(f"unknown model family {family!r}: expected one of {', '.join(families.FAMILIES)}")
        return family

    @field_validator("revision")
    @classmethod
    def _revision_of_a_repo(cls, revision: str | None, info: ValidationInfo) -> str | None:
        if revision is not None and isinstance(info.data.get("path"), Path):
            raise ValueError(f"model.path {info.data['path']} is a local path: a revision is for a Hugging Face"
                             " repo id")
        return revision

    def pinned(self, commit: str, configured: str) -> ModelConfig:
        """This repo's model at `commit`, remembering the `configured` revision it was resolved from."""
        model = self.model_copy(update={"revision": commit})
        model._configured_revision = self._configured_revision or configured
        return model

    @property
    def configured_revision(self) -> str | None:
        """The revision as the user configured it, also once `pinned` to a commit."""
        return self._configured_revision or self.revision


class DataConfig(Frozen):
    """Either `path` (one folder) or `datasets` (a list of DatasetSource: path, name, format,
    repeats, caption settings)."""

    path: PathOrUrl | None = Field(None, description="one image folder (or s3:// URL): caption sidecars or"
                                   " metadata files")
    datasets: tuple[DatasetSource, ...] = Field((), description="several datasets, each with its own settings"
                                                " (those left unset take the preprocess section's)")

    @model_validator(mode="after")
    def _one_form(self) -> "DataConfig":
        if (self.path is None) == (not self.datasets):
            raise ValueError("set either data.path or data.datasets (a list), not both or neither")
        labels = [d.label for d in self.datasets]
        clash = next((label for label in labels if labels.count(label) > 1), None)
        if clash:
            raise ValueError(f"two datasets are named {clash!r}: give them distinct `name`s")
        return self

    @field_validator("datasets")
    @classmethod
    def _a_subject(cls, datasets: tuple[DatasetSource, ...]) -> tuple[DatasetSource, ...]:
        if datasets and all(d.role == "prior" for d in datasets):
            raise ValueError("every dataset has role: prior, so there is nothing to learn: add the subject's images"
                             " as a dataset with role: train (prior images only regularise its training)")
        return datasets

    @property
    def sources(self) -> tuple[DatasetSource, ...]:
        return self.datasets or (DatasetSource(path=self.path),)


class CaptionConfig(CaptionParams, CaptionOptions):
    model: Path = Field(description="the captioner: a local transformers folder of a Florence-2 or Qwen2-VL /"
                        " Qwen2.5-VL model (config.json); keyed by the digest of its files, never its path")


class EncodeConfig(EncodeParams, EncodeOptions):
    pass


class TrainConfig(TrainParams, TrainOptions):
    pass


class EvaluateConfig(EvalParams, EvalOptions):
    pass


class ObjectStoreConfig(Frozen):
    """How this host works with an object-storage cache_dir (s3://...); unused for a local folder."""

    local_dir: Path | None = Field(None, description="this host's side of the cache: the shard cache, copies of"
                                   " artifacts it read, work directories; default `~/.cache/lorapipe/<bucket>-<id>`,"
                                   " the id a digest of the endpoint and the URL")
    shard_cache_gb: float = Field(20, gt=0, description="the most disk the shard cache may take (least recently"
                                  " used shards go first)")
    lease_seconds: float = Field(60, gt=0, description="a run that stops renewing its lease of a key (killed, its"
                                 " host gone) is taken over this long after (x1.25)")


class SweepConfig(Frozen):
    """Many trainings over one encode (docs/sweeps.md): `lorapipe sweep` trains and evaluates one
    variant per combination of `grid` values and per entry of `variants`; `lorapipe run` ignores it."""

    grid: dict[str, tuple[Any, ...]] = Field(
        default_factory=dict, description="dotted key (train.* or evaluate.*) -> the values to try; every combination"
        " of the keys' values is a variant (the cartesian product)")
    variants: tuple[dict[str, Any], ...] = Field((), description="variants besides the grid's, each a mapping of"
                                                 " dotted key -> value")
    metric: str = Field("holdout_loss", description="what picks the best variant: holdout_loss (the LoRA's held-out"
                        " loss, lower is better), train_loss, or clip_score (higher is better, needs"
                        " evaluate.clip_model)")
    concurrency: int = Field(1, ge=1, description="variants trained at once (one GPU: 1)")
    max_variants: int = Field(16, ge=1, description="more variants than this (each a training) are refused unless"
                              " `lorapipe sweep` is given --yes; --dry-run lists them without training")
    allow_data_keys: bool = Field(False, description="allow sweeping keys outside train. and evaluate. (they change"
                                  " preprocess or encode, so those run again for each variant that changes them)")

    @field_validator("grid")
    @classmethod
    def _values_to_try(cls, grid: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        empty = next((key for key, values in grid.items() if not values), None)
        if empty:
            raise ValueError(f"{empty}: no values to try")
        return grid


class PipelineConfig(Frozen):
    name: str = Field("default", pattern=r"^[\w.-]+$", description="names this pipeline's history in the cache")
    cache_dir: PathOrUrl = Field(description="a local folder, or s3://bucket/prefix")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec/s3fs options for every s3:// URL of this config (endpoint_url,"
        " profile, key, secret, ...); secrets are never passed on as Prefect parameters: give a deployment's"
        " worker its credentials in its environment (AWS_* variables)")
    object_store: ObjectStoreConfig = Field(ObjectStoreConfig(), description="how this machine works with an"
                                            " s3:// cache_dir (docs/object-storage.md); unused for a local folder")
    output_dir: Path = Field(description="where a run copies its results (LoRA files, grid, metrics, report,"
                             " run-summary.json), replacing the previous run's, and writes its log under logs/")
    cpu_threads: int | None = Field(
        None, gt=0, description="torch CPU threads per process in every stage (encode, train, evaluate), unless the"
        " stage sets its own cpu_threads; default: OMP_NUM_THREADS, else the cores less one, shared among a stage's"
        " processes (docs/training.md). Not keyed, but CPU results depend on it: keep it equal where runs must"
        " match byte for byte")
    model: ModelConfig = Field(description="the base model the LoRA is trained for")
    data: DataConfig = Field(description="the training images and their captions: `path` (one folder) or"
                             " `datasets` (a list), not both")
    preprocess: PreprocessParams = Field(PreprocessParams(), description="how images are checked, captioned,"
                                         " cropped or bucketed and split (reads headers, not pixels)")
    caption: CaptionConfig | None = Field(  # unset: no caption stage, and out of every key
        None, exclude_if=lambda v: v is None, description="generate captions with a vision-language model between"
        " preprocess and encode (docs/captions.md): which images get one is each dataset's caption_policy; images"
        " without a written caption are then not refused (missing_caption defaults to generate)")
    encode: EncodeConfig = Field(EncodeConfig(), validate_default=True,  # validated: it takes cpu_threads
                                 description="VAE latents and text records, cached per record in the sample store")
    train: TrainConfig = Field(description="the LoRA training; raising max_steps continues from the latest"
                               " checkpoint instead of starting over")
    evaluate: EvaluateConfig = Field(description="the sample grid and the denoising losses; changing any of it"
                                     " reruns evaluate alone")
    sweep: SweepConfig | None = Field(  # read by `lorapipe sweep` only; in no key
        None, exclude_if=lambda v: v is None, description="a sweep over train and evaluate settings, each variant"
        " trained and evaluated over one encode, the best published (`lorapipe sweep`, docs/sweeps.md)")

    @model_validator(mode="before")
    @classmethod
    def _generate_missing_captions(cls, raw: Any) -> Any:
        """With a caption section, an image without a written caption gets a generated one unless
        preprocess.missing_caption says otherwise (a dataset's own setting still wins)."""
        if not isinstance(raw, dict) or not raw.get("caption") or not isinstance(raw.get("preprocess", {}), dict):
            return raw
        return {**raw, "preprocess": {"missing_caption": "generate", **(raw.get("preprocess") or {})}}

    @model_validator(mode="after")
    def _generate_needs_a_captioner(self) -> "PipelineConfig":
        if self.caption is not None:
            return self
        settings = [("preprocess.missing_caption", self.preprocess.missing_caption)] + [
            (f"data.datasets.{i}.missing_caption", d.missing_caption) for i, d in enumerate(self.data.datasets)]
        where = next((key for key, value in settings if value == "generate"), None)
        if where:
            raise ValueError(f"{where}: generate needs a `caption:` section (the captioner that writes the missing"
                             " captions)")
        return self

    @field_validator("cache_dir")
    @classmethod
    def _a_cache_url(cls, cache_dir: Path | str) -> Path | str:
        """An object URL that cannot hold a cache is a config error, found before anything starts."""
        if is_url(cache_dir):
            try:
                bucket_and_prefix(cache_dir)
            except CacheRootError as error:
                raise ValueError(str(error)) from None
        return cache_dir

    @field_validator("encode", "train", "evaluate")
    @classmethod
    def _config_threads(cls, section: Frozen, info: ValidationInfo) -> Frozen:
        """A stage that does not set its cpu_threads takes the config's."""
        threads = info.data.get("cpu_threads")
        if section.cpu_threads is None and threads is not None:
            return section.model_copy(update={"cpu_threads": threads})
        return section

    @field_serializer("storage_options")
    def _hide_secrets(self, options: dict[str, Any]) -> dict[str, Any]:
        """Whatever dumps a config (Prefect's parameters, a saved config) gets secrets masked."""
        return _masked(options)

    @field_validator("storage_options")
    @classmethod
    def _drop_masked(cls, options: dict[str, Any]) -> dict[str, Any]:
        """A masked secret (a config that went through Prefect) is dropped: the environment supplies it."""
        return {k: cls._drop_masked(v) if isinstance(v, dict) else v for k, v in options.items() if v != MASK}


def _masked(value: Any, name: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _masked(v, k) for k, v in value.items()}
    return MASK if any(word in name.lower() for word in SECRET_WORDS) else value


def split(section: Frozen, params_cls: type[Frozen], options_cls: type[Frozen] | None):
    """(keyed params, unkeyed options) of a stage section."""
    values = section.model_dump()  # without the settings a model leaves out at their default
    params = params_cls(**{k: values[k] for k in params_cls.model_fields if k in values})
    options = options_cls(**{k: values[k] for k in options_cls.model_fields if k in values}) if options_cls else None
    return params, options


def apply_override(raw: dict, assignment: str, source: str) -> None:
    dotted, value = parse_override(assignment, source)
    set_key(raw, dotted, value, f"{source}: --set {dotted}")


def parse_override(assignment: str, source: str) -> tuple[str, Any]:
    """--set's key=value as (the dotted key, the value read as a YAML scalar)."""
    dotted, sep, value = assignment.partition("=")
    if not sep or not dotted:
        raise ConfigError(f"{source}: --set expects key=value, got {assignment!r}")
    return dotted, yaml.safe_load(value)


def set_key(raw: dict, dotted: str, value: Any, where: str) -> None:
    """raw[a][b][c] = value for dotted "a.b.c"; `where` begins the error's line."""
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {part} is not a section")
    node[leaf] = value


def _resolve_paths(raw: dict, base: Path) -> None:
    for dotted in ("cache_dir", "object_store.local_dir", "output_dir", "model.path",
                   *(f"model.{name}" for name in COMPONENT_KEYS), "caption.model", "data.path",
                   "train.init_lora",
                   "train.accelerate_config", *(f"evaluate.{name}" for name in LOCAL_PATHS)):
        *parents, leaf = dotted.split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str) and not is_url(node[leaf]):
            resolved = (base / local_path(node[leaf]).expanduser()).resolve()
            if dotted != "model.path" or resolved.exists() or not hub.is_repo_id(node[leaf]):  # else a repo id
                node[leaf] = str(resolved)
    datasets = raw.get("data", {}).get("datasets") if isinstance(raw.get("data"), dict) else None
    for entry in datasets if isinstance(datasets, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and not is_url(entry["path"]):
            entry["path"] = str((base / local_path(entry["path"]).expanduser()).resolve())
    encoders = raw.get("model", {}).get("text_encoders") if isinstance(raw.get("model"), dict) else None
    named = encoders.items() if isinstance(encoders, dict) else enumerate(encoders if isinstance(encoders, list) else [])
    for name, path in list(named):
        if isinstance(path, str):
            encoders[name] = str((base / Path(path).expanduser()).resolve())


def load_config(path: Path, overrides: list[str] = ()) -> PipelineConfig:
    return config_from(read_config(path, overrides), Path(path))


def read_config(path: Path, overrides: list[str] = ()) -> dict[str, Any]:
    """The config file's mapping with `overrides` (--set key=value) applied, its paths as written."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_problem(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections")
    for assignment in overrides:
        apply_override(raw, assignment, str(path))
    return raw


def config_from(raw: dict[str, Any], path: Path, source: str | None = None) -> PipelineConfig:
    """The config `raw` (read_config's, changed in place) validated, its relative paths resolved
    against `path`'s folder; an error names `source` (default: the file)."""
    _resolve_paths(raw, path.parent.resolve())
    return validate_config(raw, source or str(path))


def _yaml_problem(error: yaml.YAMLError) -> str:
    """Where and what: 'line 3, column 9: not valid YAML: expected ',' or ']', but got ...'."""
    mark = getattr(error, "problem_mark", None)
    what = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {what}" if mark else f"not valid YAML: {what}"


def validate_config(raw: dict[str, Any], source: str) -> PipelineConfig:
    try:
        return PipelineConfig(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise ConfigError(f"{source}: {where}: {err['msg']}{more}") from None
