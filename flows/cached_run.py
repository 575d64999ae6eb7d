"""A `lorapipe run` whose every stage is a cache hit, done without Prefect.

Without a configured Prefect API the command would start a temporary server (seconds) only to
record a flow run that nobody can watch, whose stages all say Cached. So when nothing is forced,
this machine is rank 0 and every stage the run walks is served from the cache, the command does
what the flow does with hits, through the same code: each stage served by `run_stage` (which
notes the use for `cache gc`), the output files copied next to run-summary.json and the run
recorded for `cache gc --keep-last` under the name `cached-<time>-<random>` (flows/outputs.py).
Anything else (a miss, an error while deciding, an artifact removed meanwhile) returns None: the
flow then runs as usual and reports it.
"""
from __future__ import annotations

import logging
import time
import uuid

from .config import PipelineConfig
from .outputs import ArtifactRemoved, finish_run, with_files
from .plan import Context, selected_stages, walked_stages
from .runner import StageNotCached, StageResult, machine_rank, run_stage

log = logging.getLogger("lorapipe.run")  # the run's log file, not the terminal


def all_cached_run(config: PipelineConfig, only: list[str], start: str | None) -> list[dict] | None:
    """The summary rows of this run served wholly from the cache without a flow, or None when it
    needs the flow (a stage to build, or an error the flow reports)."""
    if machine_rank(config) > 0:  # it joins a training: the flow's follow_train
        return None
    results = served_from_cache(config, walked_stages(selected_stages(only, start)))
    if results is None:
        return None
    try:
        return finish_run(config.output_dir, config, results, run_name(), log.info)
    except ArtifactRemoved as removed:
        log.info(f"{removed}; running the flow instead")
        return None


def served_from_cache(config: PipelineConfig, stages: tuple[str, ...]) -> list[StageResult] | None:
    """Each of `stages` served from the cache, or None at the first that is not a hit."""
    ctx = Context(config, log=log.info)
    results, upstream = [], {}
    try:
        for stage in stages:
            result, upstream[stage] = run_stage(ctx, stage, upstream, run=False)
            results.append(with_files(result, upstream[stage]))
    except StageNotCached:
        log.info(f"{stage}: not cached; running the flow")
        return None
    except Exception as error:  # noqa: BLE001  the flow meets it too, and reports it as it does
        log.info(f"{stage}: {error}; running the flow")
        return None
    finally:
        ctx.close()
    return results


def run_name() -> str:
    """How a run without a flow is named in the cache's run records (`lorapipe cache ls`)."""
    return f"cached-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
