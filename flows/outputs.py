"""What a run leaves for the user once its stages are served or built, whether the Prefect flow
ran them (flows/pipeline.py) or every stage was a cache hit and no flow ran (flows/cached_run.py):
each stage's output files (its module's OUTPUT_FILES, stages/contract.py) copied into the run's
output folder next to `run-summary.json`, and the run noted in the cache for `cache gc --keep-last`.
No Prefect here.

The output folder holds the files of one run, never a mix of two. A filesystem cannot replace
several files in one atomic step, so `run-summary.json` is the commit marker: whenever it exists,
the stage output files in the folder (OUTPUT_FILES, `ema/` and `clips/` included) are exactly those it lists
under each stage's `outputs`, all published by the run it describes; while it is missing, a
publish is under way (or was cut off, and the next run publishes again). Publishing, one run at a
time per folder (a lock file in it):
1. copy every file this run publishes into a staging folder inside the output folder (the same
   filesystem, so renames are atomic); a failure here (an artifact removed meanwhile, a full
   disk) leaves the previous run's files and summary as they were;
2. remove `run-summary.json`, then every stage output file there, whichever run wrote it (so a
   file the new run lacks, e.g. the kohya file of an earlier LoRA before a LoHa run, never stays);
3. rename each staged file into place, then the new `run-summary.json`.
During 2 the folder holds part of the previous run's files, during 3 part of this run's, never
both; a reader that opens a file in that instant finds it missing, not another training's.
Other files (logs/, train-machine-N/, a deployment's own folder, the user's) are left alone.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path
from typing import Iterable

from lorapipe.cache.errors import UserError, naming_a_full_disk
from lorapipe.cache.fsutil import fsync_dir, fsync_tree, remove_tree
from lorapipe.cache.lock import key_lock
from lorapipe.cache.object_store import open_store
from lorapipe.cache.store import Artifact
from lorapipe.stages.contract import OutputFile
from lorapipe.stages.evaluate.params import REPORT as EVALUATION_REPORT
from lorapipe.stages.preprocess.validation import findings_markdown
from lorapipe.stages.sources.model_source import resolve_base

from .config import PipelineConfig
from .steps import PIPELINE, object_settings
from .runner import StageResult, record_repairs

DECLARED = {stage: defined.module.OUTPUT_FILES for stage, defined in PIPELINE.items()}  # each stage's own declaration
FINDINGS = {stage: defined.module.FINDINGS_FILE for stage, defined in PIPELINE.items()
            if hasattr(defined.module, "FINDINGS_FILE")}  # stages/contract.py: the dataset's rejected files
FOLDERS = {f.path: f.label for files in DECLARED.values() for f in files if f.folder}  # published whole: clips/
SUMMARY_FILE = "run-summary.json"
STAGING = ".lorapipe-publishing"  # step 1's folder, inside the output folder
PUBLISH_LOCK = ".lorapipe-publish.lock"


class ArtifactRemoved(UserError):
    """An artifact's folder disappeared (`cache rm`, `cache gc`) while its files were copied out."""


def with_files(result: StageResult, artifact: Artifact | None) -> StageResult:
    """`result` naming the local folder its output files are copied from (on object storage, this
    host's copy, fetched once); stages without output files are left as they are."""
    if DECLARED[result.stage] and artifact:
        result.files = str(artifact.path)
    return result


def finish_run(out: Path, config: PipelineConfig, results: list[StageResult], run: str, log: Callable[[str], None],
               deployment: str | None = None, flow_run: str | None = None, record: bool = True) -> list[dict]:
    """Publish each stage's output files and `run-summary.json` into `out` (the module docstring
    says how), say in `log` which files, and, with `record` (machine rank 0: the run that
    published what it used), note in the cache which artifacts the run `run` used. The rows of
    stages rebuilt during a later stage read `repaired` from here on. Returns the summary's rows."""
    record_repairs(results)
    out.mkdir(parents=True, exist_ok=True)
    with naming_a_full_disk(out), key_lock(out / PUBLISH_LOCK):
        staging = out / STAGING
        remove_tree(staging)  # what a publish cut off in step 1 left
        staging.mkdir()
        try:
            for result in results:
                result.outputs = copy_outputs(result, staging)
            add_dataset_findings(staging, results)
            summary = [r.to_json() for r in results]
            (staging / SUMMARY_FILE).write_text(json.dumps(
                {"pipeline": config.name, "output_dir": str(out.resolve()), "deployment": deployment,
                 "flow_run": flow_run, "run": run, "model": model_record(config),
                 "components": components_record(config), "stages": summary}, indent=1))
            fsync_tree(staging)
            published = [name for r in results for name in r.outputs]
            dropped = swap_in(staging, out, published)
        finally:
            remove_tree(staging)
    log(f"outputs: {out}: published {said(published) or 'no stage files'} and {SUMMARY_FILE}"
        + (f"; removed the previous run's {said(dropped)}" if dropped else ""))
    if record:
        store = open_store(config.cache_dir, object_settings(config))
        store.record_run(config.name, run, {r.stage: r.key for r in results})
    return summary


def model_record(config: PipelineConfig) -> dict:
    """Where the run's base model came from: its path, or its Hugging Face repo, the revision as
    configured and the commit the run's stages resolved it to (read back from the Hugging Face
    cache, where they left it)."""
    source = resolve_base(config.model.path, config.model.revision, cached_only=True).source
    if source.commit:  # a run's config names the commit it pinned (flows/steps.py pinned)
        source = replace(source, revision=config.model.configured_revision or source.revision)
    return source.to_json()


def components_record(config: PipelineConfig) -> dict[str, str]:
    """The components the config sets over the base model, each config key -> its path as given
    (what they were converted to is keyed by their content, not recorded here)."""
    model = config.model
    given = {f"model.{name}": str(path) for name, path in model.components.items()}
    encoders = model.text_encoders or ()
    if isinstance(encoders, dict):
        given.update({f"model.text_encoders.{name}": str(path) for name, path in encoders.items()})
    else:
        given.update({f"model.text_encoders[{i}]": str(path) for i, path in enumerate(encoders)})
    return given


def add_dataset_findings(staging: Path, results: list[StageResult]) -> None:
    """Append to the staged report.md the files this run's dataset rejected and the warnings, read from
    the last stage that names them (preprocess, or caption where configured): evaluate's key holds no
    rejected file, so its own report cannot; the run's stages are consistent, so this is its dataset."""
    noted = [r for r in results if r.stage in FINDINGS and r.files]
    report = staging / EVALUATION_REPORT
    if not noted or not report.exists():
        return
    findings = json.loads((Path(noted[-1].files) / FINDINGS[noted[-1].stage]).read_text())
    report.write_text(report.read_text() + "\n" + "\n".join(findings_markdown(findings)))


def copy_outputs(result: StageResult, out: Path) -> list[str]:
    """Copy the output files `result`'s artifact has into `out`; returns their names. Raises
    ArtifactRemoved when its folder is gone afterwards: a file it lacked may have been removed with it."""
    if not result.files:
        return []
    folder, copied = Path(result.files), []
    try:
        for name in held(folder, DECLARED.get(result.stage, ())):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, out / name)
            copied.append(name)
        if folder.is_dir():
            return copied
    except FileNotFoundError:
        if folder.is_dir():
            raise
    raise ArtifactRemoved(f"{result.stage}: its artifact {result.path} was removed (lorapipe cache rm or gc)"
                          f" while its files were copied to {out}: run again to rebuild it")


def swap_in(staging: Path, out: Path, names: list[str]) -> list[str]:
    """Steps 2 and 3 of the module docstring: replace every stage output file in `out` by the
    staged `names` and the staged summary. Returns the files removed and not published again."""
    previous = [name for files in DECLARED.values() for name in held(out, files)]
    (out / SUMMARY_FILE).unlink(missing_ok=True)
    for name in previous:
        (out / name).unlink()
    for folder in folders_of(out, previous):
        if not any(folder.iterdir()):
            folder.rmdir()  # the ema/ or clips/ of an earlier run; made again below if this run has one
    fsync_dir(out)  # the removals reach the disk before any new file appears
    for name in names:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, out / name)
    for folder in folders_of(out, names):
        fsync_dir(folder)
    os.replace(staging / SUMMARY_FILE, out / SUMMARY_FILE)
    fsync_dir(out)
    return [name for name in previous if name not in names]


def held(folder: Path, files: Iterable[OutputFile]) -> list[str]:
    """The paths of the declared `files` that `folder` holds, a declared folder as each file under it."""
    names = []
    for file in files:
        path = folder / file.path
        if file.folder:
            names += sorted(p.relative_to(folder).as_posix() for p in path.rglob("*") if p.is_file())
        elif path.exists():
            names.append(file.path)
    return names


def folders_of(out: Path, names: list[str]) -> list[Path]:
    """The folders inside `out` that hold `names`, deepest first."""
    return sorted({p for name in names for p in (out / name).parents if out in p.parents}, reverse=True)


def said(names: list[str]) -> str:
    """`names` as the log says them: a declared folder's files counted ("8 clips in clips/")."""
    grouped: dict[str, list[str]] = {}
    for name in names:
        folder = next((path for path in FOLDERS if name.startswith(f"{path}/")), None)
        grouped.setdefault(folder or name, []).append(name)
    return ", ".join(f"{len(files)} {FOLDERS[key]} in {key}/" if key in FOLDERS else key
                     for key, files in grouped.items())


def named_files(out: Path) -> list[tuple[str, Path]]:
    """(label, path) of the published files `lorapipe run` names (the stages' labelled output files),
    then of the run's summary: those `out` holds."""
    named = [(f.label, out / f.path) for files in DECLARED.values() for f in files if f.label]
    return [(label, path) for label, path in [*named, ("run summary", out / SUMMARY_FILE)] if path.exists()]
