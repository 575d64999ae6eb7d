"""What a run leaves for the user once its stages are served or built, whether the Prefect flow
ran them (flows/pipeline.py) or every stage was a cache hit and no flow ran (flows/cached_run.py):
each stage's output files copied next to `run-summary.json`, and the run noted in the cache for
`cache gc --keep-last`. No Prefect here.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from cache.errors import UserError
from cache.object_store import open_store
from cache.store import Artifact

from .config import PipelineConfig
from .plan import object_settings
from .runner import StageResult

OUTPUT_FILES = {  # stage -> files copied next to the run summary for the user
    "train": ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors",
              "pytorch_lora_weights_comfyui.safetensors"),
    "evaluate": ("grid.png", "metrics.json", "report.md", "checkpoint_loss.png", "checkpoint_losses.json"),
}


class ArtifactRemoved(UserError):
    """An artifact's folder disappeared (`cache rm`, `cache gc`) while its files were copied out."""


def with_files(result: StageResult, artifact: Artifact | None) -> StageResult:
    """`result` naming the local folder its output files are copied from (on object storage, this
    host's copy, fetched once); stages without output files are left as they are."""
    if result.stage in OUTPUT_FILES and artifact:
        result.files = str(artifact.path)
    return result


def finish_run(out: Path, config: PipelineConfig, results: list[StageResult], run: str,
               deployment: str | None = None, flow_run: str | None = None, record: bool = True) -> list[dict]:
    """Copy each stage's output files into `out`, write `out/run-summary.json` and, with `record`
    (machine rank 0: the run that published what it used), note in the cache which artifacts the
    run `run` used. Returns the summary's stage rows."""
    out.mkdir(parents=True, exist_ok=True)
    for result in results:
        copy_outputs(result, out)
    summary = [r.to_json() for r in results]
    (out / "run-summary.json").write_text(json.dumps(
        {"pipeline": config.name, "output_dir": str(out.resolve()), "deployment": deployment, "flow_run": flow_run,
         "run": run, "stages": summary}, indent=1))
    if record:
        store = open_store(config.cache_dir, object_settings(config))
        store.record_run(config.name, run, {r.stage: r.key for r in results})
    return summary


def copy_outputs(result: StageResult, out: Path) -> None:
    """Copy the output files `result`'s artifact has into `out`. Raises ArtifactRemoved when its
    folder is gone afterwards: a file it lacked may have been removed with it."""
    if not result.files:
        return
    folder = Path(result.files)
    try:
        for name in OUTPUT_FILES.get(result.stage, ()):
            if (folder / name).exists():
                shutil.copyfile(folder / name, out / name)
        if folder.is_dir():
            return
    except FileNotFoundError:
        if folder.is_dir():
            raise
    raise ArtifactRemoved(f"{result.stage}: its artifact {result.path} was removed (lorapipe cache rm or gc)"
                          f" while its files were copied to {out}: run again to rebuild it")
