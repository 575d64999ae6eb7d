"""A `lorapipe run` whose every stage is a cache hit, done without Prefect.

Without a configured Prefect API the command would start a temporary server (seconds) only to
record a flow run that nobody can watch, whose stages all say Cached. So when the run's plan
(flows/run_plan.py) says it can be served wholly from the cache (nothing forced, this machine rank
0, every stage the run walks a hit), the command does what the flow does with hits, through the
same code: each hit the plan found served as `run_stage` serves one (which notes the use for
`cache gc`), the output files copied next to run-summary.json and the run recorded for `cache gc
--keep-last` under the name `cached-<time>-<random>` (flows/outputs.py). Anything else (a miss, an
artifact removed meanwhile) returns None: the flow then runs as usual and reports it.
"""
from __future__ import annotations

import logging
import time
import uuid

from .config import PipelineConfig
from .outputs import ArtifactRemoved, finish_run, with_files
from .steps import Context
from .run_plan import RunPlan
from .runner import Standing, StageNotCached, StageResult, serve_planned

log = logging.getLogger("lorapipe.run")  # the run's log file, not the terminal


def all_cached_run(config: PipelineConfig, plan: RunPlan) -> list[dict] | None:
    """The summary rows of this run served wholly from the cache without a flow, or None when it
    needs the flow (a stage to build, or an error the flow reports)."""
    if not plan.served_from_cache():  # on machine rank > 0 it joins a training: the flow's follow_train
        return None
    results = served_from_cache(config, plan.standings)
    if results is None:
        return None
    try:
        return finish_run(config.output_dir, config, results, run_name(), log.info)
    except ArtifactRemoved as removed:
        log.info(f"{removed}; running the flow instead")
        return None


def served_from_cache(config: PipelineConfig, standings: tuple[Standing, ...]) -> list[StageResult] | None:
    """Each of the planned hits served from the cache, or None at the first that is gone since."""
    ctx = Context(config, log=log.info)
    results = []
    try:
        for standing in standings:
            results.append(with_files(*serve_planned(ctx, standing)))
    except StageNotCached as gone:
        log.info(f"{gone}; running the flow")
        return None
    except Exception as error:  # noqa: BLE001  the flow meets it too, and reports it as it does
        log.info(f"{standing.stage}: {error}; running the flow")
        return None
    finally:
        ctx.close()
    return results


def run_name() -> str:
    """How a run without a flow is named in the cache's run records (`lorapipe cache ls`)."""
    return f"cached-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
