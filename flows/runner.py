"""Runs one stage through the cache: decide hit or miss (and why), build on a miss, remember.

No Prefect here: the flow's tasks call `run_stage` (train's own ways: flows/training.py), a run's
plan and `lorapipe status` call `stand`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from lorapipe.cache.errors import UserError
from lorapipe.cache.samples import DamagedRecord
from lorapipe.cache.store import Artifact, Lookup, StageKey, diff_ingredients

from .steps import Context, Step, code_digest, config_stages, reads_of, step_for


class StageNotCached(UserError):
    """A stage that was not selected to run has no valid artifact for this config."""


@dataclass
class StageResult:
    stage: str
    status: str  # "computed" or "hit"; "joined" for train on machine rank > 0 (rank 0 publishes); "repaired"
    key: str
    digest: str
    path: str  # where the artifact is: its folder, or its URL on object storage
    seconds: float
    reason: str
    info: dict[str, Any] = field(default_factory=dict)
    prefect_state: str | None = None  # the task run's state name, when run by the flow
    files: str = ""  # a local folder with its files, when the flow reads them (on object storage, this host's copy)
    outputs: list[str] = field(default_factory=list)  # its files this run published into the output folder
    repairs: list[dict[str, Any]] = field(default_factory=list)  # rebuilt while a later stage ran: "repaired"
    rebuilt: list[StageResult] = field(default_factory=list)  # the earlier stages this one rebuilt (record_repairs)

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        del row["rebuilt"]  # shown on the rebuilt stages' own rows (record_repairs)
        return row


def miss_reason(ctx: Context, key: StageKey, found: Lookup) -> str:
    """Why `key` is not served from the cache, in terms of what changed since the last run."""
    previous = ctx.store.previous(ctx.config.name, key.stage)
    if previous is None:
        return f"{found.reason} (no earlier run of pipeline {ctx.config.name!r})"
    if previous["key"] == key.key:
        return found.reason  # same ingredients: the artifact itself is missing or damaged
    changed = diff_ingredients(previous["ingredients"], key.ingredients)
    return "changed: " + ", ".join(changed)


def hit_note(stage: str, artifact: Artifact) -> str:
    if artifact.manifest["producer"].get("code") not in (None, code_digest(stage)):
        return "hit (the stage's code changed since; its VERSION did not, so the artifact stands)"
    return "hit"


def run_stage(ctx: Context, stage: str, upstream: dict[str, Artifact], *, run: bool = True,
              force: bool = False) -> tuple[StageResult, Artifact]:
    """Serve `stage` from the cache or build it. With run=False a miss is an error."""
    started = time.time()
    step: Step = step_for(stage, ctx, upstream)
    key = step.key
    found = ctx.store.lookup(stage, key.key)
    if found.hit and not force:
        return used(ctx, key, found.artifact, "hit", hit_note(stage, found.artifact), started)
    if not run:
        raise StageNotCached(f"{stage} is not selected to run and has no cached artifact for this config "
                             f"({miss_reason(ctx, key, found)}); run it first or drop --only/--from")
    reason = "forced" if force else miss_reason(ctx, key, found)
    what = "rebuilding it and discarding its work directory" if force else "computing"
    ctx.log(f"{stage}: {'--force' if force else 'miss'} ({reason}); {what} {key.key[:12]}")
    key, artifact, computed, rebuilt = build_repairing(ctx, stage, step, upstream, force)
    if not computed:
        reason = "built meanwhile by a concurrent run" + (" (forced too: one rebuild serves both)" if force else "")
    return used(ctx, key, artifact, "computed" if computed else "hit", reason, started, rebuilt)


def serve_planned(ctx: Context, standing: Standing) -> tuple[StageResult, Artifact]:
    """A hit the plan found (flows/run_plan.py), served as `run_stage` serves one, without keying
    the stage again; looked up again, since it may have been removed meanwhile."""
    started = time.time()
    found = ctx.store.lookup(standing.stage, standing.key.key)
    if not found.hit:
        raise StageNotCached(f"{standing.stage}: {found.reason} since the run was planned")
    return used(ctx, standing.key, found.artifact, "hit", hit_note(standing.stage, found.artifact), started)


def used(ctx: Context, key: StageKey, artifact: Artifact, status: str, reason: str, started: float,
         rebuilt: list[StageResult] | None = None) -> tuple[StageResult, Artifact]:
    """Note that this pipeline used `artifact` (for miss reasons and gc) and say so; its result."""
    ctx.store.remember(ctx.config.name, key, artifact)
    ctx.log(f"{key.stage}: {status} {artifact.location}")
    work_done = artifact.manifest.get("info", {}) if status == "computed" else {}  # a hit computed nothing this run
    result = StageResult(key.stage, status, key.key, artifact.digest, str(artifact.location),
                         round(time.time() - started, 3), reason, work_done, rebuilt=rebuilt or [])
    return result, artifact


def build_repairing(ctx: Context, stage: str, step: Step, upstream: dict[str, Artifact],
                    force: bool = False) -> tuple[StageKey, Artifact, bool, list[StageResult]]:
    """Build `step`. When it meets a damaged record (train and evaluate check every record they
    read), drop that record's shard, rebuild encode (the same key: only the shard's records are
    encoded again) and the stages up to this one (hits when the data is unchanged), then build
    again (not forced: training resumes from its last checkpoint). Returns (key, artifact,
    computed, the results of the earlier stages computed again, each with the damage as reason)."""
    repaired: set[str] = set()
    rebuilt: list[StageResult] = []
    while True:
        try:
            artifact, computed = ctx.store.build(step.key, step.build, ctx.producer(stage), ctx.log, force=force)
            return step.key, artifact, computed, rebuilt
        except DamagedRecord as damage:
            dataset_missing = any(name not in upstream for name in reads_of("encode", ctx.config))
            if damage.shard in repaired or dataset_missing:  # damaged again, or no input to encode from: not ours
                raise
            repaired.add(damage.shard)
            why = f"{damage.path}: record {damage.key} {damage.problem}"
            ctx.log(f"{stage}: {why}; dropping the shard and encoding its records again")
            ctx.store.sample_store().remove(damage.shard)
            upstream = dict(upstream)
            stages = config_stages(ctx.config)
            for earlier in stages[stages.index("encode"):stages.index(stage)]:
                result, upstream[earlier] = run_stage(ctx, earlier, upstream)
                if result.status == "computed":
                    result.reason = why
                    rebuilt.append(result)
            step, force = step_for(stage, ctx, upstream), False


def record_repairs(results: list[StageResult]) -> None:
    """Move what a stage rebuilt while it ran (a damaged shard encoded again) onto the rebuilt
    stage's own row, which then reads "repaired" with why, how long and what it did (`info`'s
    counts): a row that said hit must not hide the work."""
    rows = {r.stage: r for r in results}
    for result in results:
        for rebuilt in result.rebuilt:
            row = rows[rebuilt.stage]
            row.status = "repaired"
            row.repairs.append({"during": result.stage, "reason": rebuilt.reason, "seconds": rebuilt.seconds,
                                "info": rebuilt.info})
        result.rebuilt = []


@dataclass(frozen=True)
class Standing:
    """How a stage stands in the cache before a run: its key and, for a hit, its artifact."""

    stage: str
    key: StageKey | None  # None: an earlier stage is a miss, so its key is not known yet
    artifact: Artifact | None  # a hit's
    reason: str  # the hit's note, or why it is a miss

    def row(self) -> dict[str, Any]:
        """As `lorapipe status` prints it."""
        row = {"stage": self.stage, "status": "hit" if self.artifact else "miss",
               "key": self.key.key if self.key else None, "reason": self.reason}
        return {**row, "path": str(self.artifact.location)} if self.artifact else row


def stand(ctx: Context, stages: tuple[str, ...]) -> list[Standing]:
    """How each of `stages` stands, without running anything."""
    upstream: dict[str, Artifact] = {}
    standings = []
    for stage in stages:
        if any(s not in upstream for s in stages[: stages.index(stage)]):
            standings.append(Standing(stage, None, None,
                                      "an earlier stage will be recomputed; its key is known after that"))
            continue
        key = step_for(stage, ctx, upstream).key
        found = ctx.store.lookup(stage, key.key)
        if found.hit:
            upstream[stage] = found.artifact
            standings.append(Standing(stage, key, found.artifact, hit_note(stage, found.artifact)))
        else:
            standings.append(Standing(stage, key, None, miss_reason(ctx, key, found)))
    return standings


def on_last_inputs(ctx: Context, stage: str) -> Artifact | None:
    """`stage`'s artifact for this config built on the artifacts this pipeline last used of the stages
    it reads; None where one of them, or it, is not in the cache. For a stage whose upstream is a
    miss only because the data changed since (`captions export`: its own sidecars are new captions)."""
    upstream = {}
    for name in reads_of(stage, ctx.config):
        ref = ctx.store.previous(ctx.config.name, name)
        found = ctx.store.lookup(name, ref["key"]) if ref else None
        if found is None or not found.hit:
            return None
        upstream[name] = found.artifact
    found = ctx.store.lookup(stage, step_for(stage, ctx, upstream).key.key)
    return found.artifact if found.hit else None


def explain(ctx: Context, stages: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per stage: key, hit or miss and why, without running anything (`lorapipe status`)."""
    return [standing.row() for standing in stand(ctx, stages)]
