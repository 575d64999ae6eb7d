"""What a command decides once, before anything runs: the run's plan.

The stages it walks (the chosen ones, `--only` / `--from`, and every stage before them, which must
be cache hits; on machine rank > 0 none after train), those it forces, how each stands in the cache
(`lorapipe status`'s rows), whether a warm process is worth starting for its training, and where
each stage's job runs (stages/processes/placement.py `place`, from the stage's settings and that warm process).

`lorapipe run` plans once (`plan_run`) and hands the plan to the run served wholly from the cache
(flows/cached_run.py) or to the flow (flows/pipeline.py); `lorapipe status` prints the standings of
its plan (`plan_status`); a deployment's flow run plans for itself (`plan_flow`: no standings, it
runs what it walks). The flow's tasks key each stage again as they run it: a stage built by the run
changes the keys after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from lorapipe.cache.errors import UserError, unusable_folder
from lorapipe.stages import train
from lorapipe.stages.contract import Log
from lorapipe.stages.processes.placement import OwnProcess, Placement, WarmProcess, place

from .config import PipelineConfig, split
from .steps import PIPELINE, Context, config_stages
from .runner import Standing, stand
from .training import machine_rank


@dataclass(frozen=True)
class RunPlan:
    """What a command decided before running anything (see the module docstring)."""

    chosen: frozenset[str]  # the stages to serve or build
    walked: tuple[str, ...]  # in order: the chosen ones and those before them (served from the cache)
    forced: frozenset[str]  # rebuilt even when cached
    rank: int  # this machine's in a training across machines
    standings: tuple[Standing, ...] | None = None  # of the walked stages; None: not asked, or no answer
    placements: Mapping[str, Placement] = field(default_factory=dict)  # stage -> where its job runs

    def building(self) -> frozenset[str]:
        """The chosen stages the run will build rather than serve from the cache, as the standings
        say (all chosen ones without them): a guess, which decides only what starts early."""
        if self.standings is None:
            return self.chosen
        return frozenset(s.stage for s in self.standings
                         if s.stage in self.chosen and (s.artifact is None or s.stage in self.forced))

    def served_from_cache(self) -> bool:
        """Whether the run can be served wholly from the cache, without a flow (flows/cached_run.py):
        every stage walked a hit, none forced, on machine rank 0 (the others join a training)."""
        return (self.rank == 0 and not self.forced and self.standings is not None
                and all(s.artifact is not None for s in self.standings))

    def built_here(self) -> frozenset[str]:
        """The stages the run builds in this process (their model code is imported here)."""
        return frozenset(s for s in self.building() if s not in self.placements or self.placements[s].here)

    def warm_process(self, config: PipelineConfig) -> WarmProcess | None:
        """A warm process started now for the run's training, when it will train in one process of
        its own; its imports overlap Prefect's start and the stages before train, which hand it
        their jobs too (the command owns it: a context manager). None otherwise."""
        if "train" not in self.building():
            return None
        alone = place(PIPELINE["train"].where(config))
        if not isinstance(alone, OwnProcess):
            return None
        params, options = split(config.train, train.TrainParams, train.TrainOptions)
        return WarmProcess(alone.threads(options.cpu_threads), train.unused_libraries(params))

    def placed(self, config: PipelineConfig, warm: WarmProcess | None = None) -> RunPlan:
        """This plan with the placement of each stage it builds: the one rule (stages/processes/placement.py)
        applied to the stage's settings, with the warm process when the command started one. (A
        stage built against the plan, e.g. encode repairing a damaged shard, runs where its own
        settings say.)"""
        return replace(self, placements={stage: place(PIPELINE[stage].where(config), warm)
                                         for stage in self.building() if PIPELINE[stage].where})


def select(config: PipelineConfig, only: list[str], start: str | None, force: list[str]) -> RunPlan:
    """The stages a run walks, chooses and forces (an unknown stage name is the command's error)."""
    stages = config_stages(config)
    selected_stages(stages, force, None)
    chosen, rank = selected_stages(stages, only, start), machine_rank(config)
    return RunPlan(frozenset(chosen), walked_stages(stages, chosen, rank), frozenset(force), rank)


def plan_run(config: PipelineConfig, only: list[str], start: str | None, force: list[str], log: Log) -> RunPlan:
    """`lorapipe run`'s plan. What can be checked before Prefect starts fails here, in one line: the
    stage names, OMP_NUM_THREADS, that output_dir and the cache can be written, that the model is
    whole and supported. The standings are best effort: an error there is the flow's to report."""
    from lorapipe.cache.fsutil import probe_writable
    from lorapipe.stages.processes.cpu_threads import environment_threads

    plan = select(config, only, start, force)
    environment_threads()
    try:
        probe_writable(config.output_dir)
    except OSError as error:
        raise UserError(unusable_folder("output_dir", config.output_dir, error)) from error
    ctx = Context(config, log=log)  # its store's note about this host's side, if any
    try:
        ctx.model_digests  # noqa: B018 (reads the model index, checks every weights file, hashes new ones)
        ctx.declared_family  # noqa: B018
        ctx.model_path  # noqa: B018 (the folder the stages load: a single file converted, components composed; once)
        try:
            return replace(plan, standings=tuple(stand(ctx, plan.walked)))
        except Exception:  # noqa: BLE001  the flow meets it and reports it as it does
            return plan
    finally:
        ctx.close()


def plan_status(config: PipelineConfig, log: Log) -> RunPlan:
    """`lorapipe status`'s plan: a whole run's, with every stage's standing (reading the cache only)."""
    plan = select(config, [], None, [])
    ctx = Context(config, log=log, reads_only=True)
    try:
        stages = config_stages(config)
        return replace(plan, walked=stages, standings=tuple(stand(ctx, stages)))
    finally:
        ctx.close()


def plan_flow(config: PipelineConfig, only: list[str], start: str | None, force: list[str],
              warm: WarmProcess | None = None) -> RunPlan:
    """The plan of a flow run that was handed none (a deployment's, a sweep's variant in `warm`, the
    process it took): its stages and placements."""
    return select(config, only, start, force).placed(config, warm)


def selected_stages(stages: tuple[str, ...], only: list[str], start: str | None) -> set[str]:
    """The stages (of the config's `stages`) `--only` / `--from` select (all by default)."""
    for name in [*only, *([start] if start else [])]:
        if name not in stages:
            unused = " (a stage this config does not run)" if name in PIPELINE else ""
            raise UserError(f"unknown stage {name!r}{unused}: expected one of {', '.join(stages)}")
    if only:
        return set(only)
    return set(stages[stages.index(start):]) if start else set(stages)


def walked_stages(stages: tuple[str, ...], chosen: set[str], rank: int = 0) -> tuple[str, ...]:
    """The stages (of the config's `stages`) a run goes through, in order: the chosen ones and every
    stage before them (which must be cache hits); on machine rank > 0 none after train (rank 0
    publishes and evaluates)."""
    last = max(stages.index(s) for s in chosen)
    if rank > 0:  # this machine only joins the training
        last = min(last, stages.index("train"))
    return stages[: last + 1]
