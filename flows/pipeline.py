"""The lorapipe flow: preprocess -> [caption] -> encode -> train -> evaluate, Prefect tasks passing
artifacts (caption only where the config has a `caption:` section).
Each stage is served from the cache when nothing it depends on changed, as our manifests decide (a
hit shows in Prefect as a "Cached" state), and built otherwise (flows/runner.py); where its job
runs was decided once by the run's plan (flows/run_plan.py). What each stage reads and how it is
keyed: flows/steps.py.

    lorapipe run configs/demo.yaml            # or: python -m lorapipe.flows.pipeline CONFIG
    prefect deploy --all                      # the deployments in prefect.yaml (docs/service.md, "Deployments")
"""
from __future__ import annotations

import errno
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Literal, NamedTuple

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run, task_run
from prefect.states import Completed
from pydantic.json_schema import SkipJsonSchema

from lorapipe.cache.errors import UserError
from lorapipe.cache.store import Artifact
from lorapipe.stages.processes.launching import WorkerCrashed
from lorapipe.stages.processes.library_notes import quiet_harmless_notes
from lorapipe.stages.processes.optional_libraries import hide

from .artifacts import StageProgress, publish_run_artifacts
from .config import PipelineConfig, load_config
from .outputs import finish_run, with_files
from .steps import ALL_STAGES, Context, pinned
from .run_record import current
from .run_plan import RunPlan, plan_flow
from .runner import StageResult, run_stage
from .training import follow_train, machine_folder, run_warm_train

Stage = Literal[ALL_STAGES]  # typed, so Prefect refuses a misspelt stage

TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ESTALE, errno.ETIMEDOUT, errno.ECONNRESET,
                    errno.ECONNABORTED}  # a busy or briefly unreachable (network) filesystem


@flow(name="lorapipe", log_prints=True)
def pipeline(config: PipelineConfig, only: list[Stage] = [], start: Stage | None = None,  # noqa: B006
             force: list[Stage] = [], warm_start: bool = False,  # noqa: B006
             plan: SkipJsonSchema[RunPlan | None] = None) -> list[dict]:
    """Run the stages, each served from the cache when nothing it depends on changed.

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
    config = pinned(config)  # a deployment's run; the command's is already (resolving a commit again is a no-op)
    plan = plan or plan_flow(config, only, start, force)
    data = dataset_stages(config, plan)
    lora = train(config, plan, data.enc, warm_start)
    scores = evaluate(config, plan, data.dataset, data.enc, lora)
    out = output_folder(config) if plan.rank == 0 else machine_folder(output_folder(config), plan.rank)
    return published(config, out, [*data, lora, scores], record=plan.rank == 0)


class DatasetStages(NamedTuple):
    """What train and evaluate read: preprocess's, caption's (None where not configured) and encode's."""

    pre: Done | None
    cap: Done | None
    enc: Done | None

    @property
    def dataset(self) -> Done | None:
        """The caption stage's where configured (its readers read preprocess's otherwise)."""
        return self.cap or self.pre


def dataset_stages(config: PipelineConfig, plan: RunPlan) -> DatasetStages:
    pre = preprocess(config, plan)
    cap = caption(config, plan, pre)
    return DatasetStages(pre, cap, encode(config, plan, cap or pre))


def published(config: PipelineConfig, out: Path, done: list[Done | None], record: bool = True) -> list[dict]:
    """The stages' files and run summary published into `out` (flows/outputs.py), and the run's
    Prefect artifacts; the summary's rows."""
    results = [d.result for d in done if d]
    summary = finish_run(out, config, results, flow_run.name or "unnamed", get_run_logger().info,
                         deployment=deployment.name, flow_run=flow_run.name, record=record)
    publish_run_artifacts(config.name, results, out)
    return summary


@dataclass
class Done:
    """What a stage task hands on: its row of the run's summary, and its artifact (None for the
    training machine rank > 0 joins: rank 0 publishes it)."""

    result: StageResult
    artifact: Artifact | None


def may_succeed_on_retry(_task, _task_run, state) -> bool:
    """Retry a stage whose worker process died without reporting an error (a signal, the OOM
    killer), or that hit a transient filesystem error; never one that failed on its input."""
    error = state.data
    return isinstance(error, WorkerCrashed) or (isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS)


def stage_task(body: Callable[..., Done]) -> Callable[..., Done | None]:
    """`body` as the Prefect task of the stage it is named after: retried as `may_succeed_on_retry`
    says (a retry resumes: train from its last checkpoint, encode after its last shard), a hit
    shown as Cached. Called, it runs when the run's plan walks the stage, else returns None."""
    stage = body.__name__

    @wraps(body)
    def reported(*args, **kwargs) -> Done | Completed:
        done = body(*args, **kwargs)
        with_files(done.result, done.artifact)
        if done.result.status == "hit":
            return Completed(name="Cached", message=f"{stage}: served from {done.result.path}", data=done)
        return done

    prefect_task = task(reported, name=stage, cache_policy=NO_CACHE, persist_result=False, retries=2,
                        retry_delay_seconds=5, retry_condition_fn=may_succeed_on_retry)

    @wraps(body)
    def call(config: PipelineConfig, plan: RunPlan, *args) -> Done | None:
        if stage not in plan.walked:
            return None
        state = prefect_task(config, plan, *args, return_state=True)
        try:
            done = state.result()
        except BaseException:
            current().stages.append({"stage": stage, "status": "failed"})
            raise
        done.result.prefect_state = state.name
        current().stages.append(done.result.to_json())
        return done

    return call


@stage_task
def preprocess(config: PipelineConfig, plan: RunPlan) -> Done:
    return served_or_built(config, plan, "preprocess")


@stage_task
def caption(config: PipelineConfig, plan: RunPlan, pre: Done) -> Done:
    return served_or_built(config, plan, "caption", pre)


@stage_task
def encode(config: PipelineConfig, plan: RunPlan, dataset: Done) -> Done:
    """`dataset`: the caption stage's artifact where configured, else preprocess's."""
    return served_or_built(config, plan, "encode", dataset)


@stage_task
def train(config: PipelineConfig, plan: RunPlan, enc: Done, warm_start: bool) -> Done:
    """Train's own ways (flows/training.py): on machine rank > 0 join rank 0's training; with
    `warm_start`, start from this pipeline's previous LoRA."""
    with stage_context(config, plan, "train") as ctx:
        upstream, run = artifacts_of(enc), "train" in plan.chosen
        if plan.rank > 0:
            if warm_start:
                raise UserError("warm_start: not supported with train.machine_rank > 0; start the runs without it")
            return Done(*follow_train(ctx, upstream, run))
        if warm_start:
            return Done(*run_warm_train(ctx, upstream, run=run, force=forced(plan, "train")))
        return Done(*run_stage(ctx, "train", upstream, run=run, force=forced(plan, "train")))


@stage_task
def evaluate(config: PipelineConfig, plan: RunPlan, dataset: Done, enc: Done, lora: Done) -> Done:
    return served_or_built(config, plan, "evaluate", dataset, enc, lora)


def served_or_built(config: PipelineConfig, plan: RunPlan, stage: str, *inputs: Done) -> Done:
    """`stage` served from the cache, or built from the artifacts of `inputs` (flows/runner.py)."""
    with stage_context(config, plan, stage) as ctx:
        return Done(*run_stage(ctx, stage, artifacts_of(*inputs), run=stage in plan.chosen,
                               force=forced(plan, stage)))


@contextmanager
def stage_context(config: PipelineConfig, plan: RunPlan, stage: str) -> Iterator[Context]:
    """The stage's Context, logging into the task's run log and its progress artifact, with the plan's placements."""
    logger, progress = get_run_logger(), StageProgress(stage)

    def log(line: str) -> None:
        logger.info(line)
        progress(line)

    ctx = Context(config, log=log, placements=plan.placements)
    try:
        yield ctx
    finally:
        ctx.close()


def artifacts_of(*inputs: Done) -> dict[str, Artifact]:
    return {done.result.stage: done.artifact for done in inputs}


def forced(plan: RunPlan, stage: str) -> bool:
    """Whether to discard the stage's artifact and work directory: on its first attempt only, so
    that a retry resumes."""
    return stage in plan.forced and task_run.run_count <= 1


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
