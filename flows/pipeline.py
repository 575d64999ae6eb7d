"""The lorapipe flow: preprocess -> encode -> train -> evaluate, each a Prefect task whose
hit or miss is decided by our cache manifest (a hit shows in Prefect as a "Cached" state).

    lorapipe run configs/demo.yaml            # or: python -m lorapipe.flows.pipeline CONFIG
    prefect deploy --all                      # the deployments in prefect.yaml (README: "Running as a service")
"""
from __future__ import annotations

import errno
import re
import sys
from functools import partial
from pathlib import Path
from typing import Literal, get_args

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run, task_run
from prefect.states import Completed
from pydantic.json_schema import SkipJsonSchema

from lorapipe.cache.errors import UserError
from lorapipe.stages.launching import WorkerCrashed
from lorapipe.stages.library_notes import quiet_harmless_notes
from lorapipe.stages.optional_libraries import hide

from .artifacts import StageProgress, publish_run_artifacts
from .config import PipelineConfig, load_config
from .outputs import finish_run, with_files
from .plan import STAGES, Context
from .run_plan import RunPlan, plan_flow
from .runner import StageResult, follow_train, machine_folder, run_stage, run_warm_train

Stage = Literal["preprocess", "encode", "train", "evaluate"]  # typed, so Prefect refuses a misspelt stage
assert get_args(Stage) == STAGES

TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ESTALE, errno.ETIMEDOUT, errno.ECONNRESET,
                    errno.ECONNABORTED}  # a busy or briefly unreachable (network) filesystem


def may_succeed_on_retry(_task, _task_run, state) -> bool:
    """Retry a stage whose worker process died without reporting an error (a signal, the OOM
    killer), or that hit a transient filesystem error; never one that failed on its input."""
    error = state.data
    return isinstance(error, WorkerCrashed) or (isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS)


@task(cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=5,
      retry_condition_fn=may_succeed_on_retry)
def stage_task(config: PipelineConfig, plan: RunPlan, stage: str, upstream: dict[str, str], warm_start: bool = False):
    """One stage. `upstream` maps earlier stages to their artifact keys; `warm_start` makes train
    begin from this pipeline's previous LoRA. A retry resumes (train from its last checkpoint,
    encode after its last shard): a forced stage discards its work directory on the first attempt only."""
    logger, progress = get_run_logger(), StageProgress(stage)
    force = stage in plan.forced and task_run.run_count <= 1

    def log(line: str) -> None:
        logger.info(line)
        progress(line)

    ctx = Context(config, log=log, placements=plan.placements)
    try:
        artifacts = {s: ctx.store.lookup(s, k).artifact for s, k in upstream.items()}
        following = stage == "train" and plan.rank > 0
        if following and warm_start:
            raise UserError("warm_start: not supported with train.machine_rank > 0; start the runs without it")
        stage_run = follow_train if following else run_warm_train if warm_start else partial(run_stage, stage=stage)
        result = with_files(*stage_run(ctx, upstream=artifacts, run=stage in plan.chosen, force=force))
    finally:
        ctx.close()
    if result.status == "hit":
        return Completed(name="Cached", message=f"{stage}: served from {result.path}", data=result)
    return result


@flow(name="lorapipe", log_prints=True)
def pipeline(config: PipelineConfig, only: list[Stage] = [], start: Stage | None = None,  # noqa: B006
             force: list[Stage] = [], warm_start: bool = False,  # noqa: B006
             plan: SkipJsonSchema[RunPlan | None] = None) -> list[dict]:
    """Run the four stages, each served from the cache when nothing it depends on changed.

    Args:
        config: the pipeline config (the YAML file's content; paths are absolute or relative to the
            worker's working directory, the repository root)
        only: run only these stages (`--only`); the stages before them must already be cached
        start: run this stage and those after it (`--from`)
        force: rebuild these stages, discarding their artifacts and train's checkpoints (`--force`)
        warm_start: start training from this pipeline's previous LoRA instead of from scratch
        plan: what the command decided for these (flows/run_plan.py), with the warm process it
            owns; none in a deployment's run, which plans here (not a deployment parameter)
    """
    quiet_harmless_notes()  # in a deployment's flow process too
    if deployment.id:  # a process of its own, started for this run: hide what `lorapipe run` hides (flows/cli.py)
        hide()  # before a stage imports diffusers; training runs in processes of its own, with its own choice
    plan = plan or plan_flow(config, only, start, force)
    results: list[StageResult] = []
    upstream: dict[str, str] = {}
    for stage in plan.walked:
        state = stage_task.with_options(name=stage)(
            config, plan, stage, dict(upstream), warm_start and stage == "train", return_state=True)
        result: StageResult = state.result()
        result.prefect_state = state.name
        results.append(result)
        upstream[stage] = result.key
    out = output_folder(config) if plan.rank == 0 else machine_folder(output_folder(config), plan.rank)
    summary = finish_run(out, config, results, flow_run.name or "unnamed", get_run_logger().info,
                         deployment=deployment.name, flow_run=flow_run.name, record=plan.rank == 0)
    publish_run_artifacts(config.name, results, out)
    return summary


def output_folder(config: PipelineConfig) -> Path:
    """output_dir itself for a CLI run; output_dir/<deployment name> for a deployment run, so a
    scheduled retrain never overwrites what a manual run of another deployment made."""
    name = deployment.name
    if not name:
        return config.output_dir
    return config.output_dir / (re.sub(r"[^\w.-]+", "-", name).strip(".") or "deployment")


if __name__ == "__main__":
    hide()  # as a deployment's flow run does
    pipeline(load_config(Path(sys.argv[1])))
