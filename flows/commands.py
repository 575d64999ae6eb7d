"""What each CLI command does and prints (the parser lives in cli.py)."""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections import Counter
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from lorapipe.cache.errors import UserError

from .config import PipelineConfig, load_config
from .run_record import current

if TYPE_CHECKING:
    from lorapipe.stages.preprocess.sources import DatasetSource
    from lorapipe.stages.processes.placement import WarmProcess

    from .run_plan import RunPlan
    from .server import EmbeddedServer
    from .sweep.grid import Sweep


def _print_json(value) -> None:
    print(json.dumps(value, indent=1, default=str))


def note(line: str) -> None:
    """A line for the user beside the command's output (stdout stays the summary or the JSON)."""
    print(f"lorapipe: {line}", file=sys.stderr, flush=True)


def import_model_code_ahead(config: PipelineConfig, building: frozenset[str]) -> threading.Thread:
    """A thread importing the model code of the stages this process builds (encode and evaluate,
    when their placement is this process: RunPlan.built_here), so that its seconds overlap the wait
    for Prefect's server. Best effort: the stage meets any error itself."""
    from lorapipe.stages.families import for_model
    from lorapipe.stages.models import import_model_code
    from lorapipe.stages.sources.model_source import resolve_base

    def import_all() -> None:
        try:
            model = resolve_base(config.model.path, config.model.revision, cached_only=True).path
            family = for_model(model, config.model.family)
            for stage in sorted({"encode", "evaluate"} & building):
                import_model_code(model, family, stage)
        except Exception:  # noqa: BLE001, S110
            pass

    thread = threading.Thread(target=import_all, name="import-model-code", daemon=True)
    thread.start()
    return thread


NO_FLOW = ("lorapipe: every stage was cached, so no Prefect flow ran (Prefect records nothing of this run); to"
           " have such runs in the Prefect UI, keep a Prefect server running (docs/service.md, \"Fast repeated runs\")")


class KeptWarmProcess:
    """The process started ahead by the first of a command's runs that trains, kept for its later
    runs (`lorapipe demo` with several --arch), so that they import torch and the rest once; the
    command's ExitStack ends it."""

    def __init__(self, stack: ExitStack) -> None:
        self.stack, self.process = stack, None

    def for_run(self, plan: RunPlan, config: PipelineConfig) -> WarmProcess | None:
        """The kept process (a new one when it died), else one started now if this run trains in one."""
        if self.process is None or not self.process.alive():
            started = plan.warm_process(config)
            self.process = self.stack.enter_context(started) if started else None
        return self.process


def run(config_path: Path, overrides: list[str], only: list[str], start: str | None,
        force: list[str], as_json: bool, debug: bool = False, server: EmbeddedServer | None = None,
        kept: KeptWarmProcess | None = None, more_runs: bool = False) -> int:
    """`lorapipe run`. `kept`: the process started ahead that earlier runs of the command trained in;
    `more_runs`: another run follows on the same server (an all-hit run leaves it running)."""
    from .run_plan import plan_run
    from .runlog import new_log_path, run_log
    from .steps import pinned

    config = pinned(load_config(config_path, overrides))
    current().pipeline = config.name
    plan = plan_run(config, only, start, force, note)  # what fails here is the command's only line
    print(f"lorapipe: running pipeline {config.name!r} ({config_path}): starting Prefect", file=sys.stderr,
          flush=True)  # with Prefect's log lines; stdout stays the summary (--json)
    log_path = current().log = new_log_path(config.output_dir)
    if server and plan.served_from_cache():  # a temporary server would record a run nobody sees
        from .cached_run import all_cached_run

        with run_log(log_path, debug, flow=False):
            summary = all_cached_run(config, plan)
        if summary is not None:
            if not more_runs:
                server.stop()
            print(NO_FLOW, file=sys.stderr)
            return print_summary(config, summary, log_path, as_json)
    # its imports overlap Prefect's start and the stages before train; encode and evaluate hand it their jobs
    with nullcontext(kept.for_run(plan, config)) if kept else plan.warm_process(config) or nullcontext() as warm:
        plan = plan.placed(config, warm)
        if server and not server.connect():
            server = None  # the API that Prefect's own settings name is used instead
        from .pipeline import pipeline

        if server:
            importing = import_model_code_ahead(config, plan.built_here())  # now that this thread's imports are done
            server.wait_ready()
            importing.join()  # before the flow imports anything: never two threads in one module's import
        with run_log(log_path, debug):
            summary = pipeline(config, only=only, start=start, force=force, plan=plan)
    return print_summary(config, summary, log_path, as_json)


def demos(workdir: Path, arches: list[str], edits: bool, caption: bool, overrides: list[str], debug: bool,
          server: EmbeddedServer | None) -> int:
    """`lorapipe demo` with several --arch: each family's demo in turn in WORKDIR/ARCH, on one Prefect
    server and one process started ahead. A demo that fails says so in one line and the others still
    run; the exit status is the worst of theirs."""
    from .command_errors import error_line, exit_code
    from .demo import demo_heading, prepare_demo

    worst = 0
    with ExitStack() as stack:
        kept = KeptWarmProcess(stack)
        for number, arch in enumerate(arches, 1):
            heading = demo_heading(arch, workdir / arch, number, len(arches))
            print(f"\n{heading}", flush=True)
            note(heading)
            try:
                config = prepare_demo(workdir / arch, arch, edits, caption)
                run(config, overrides, [], None, [], False, debug, server, kept, more_runs=number < len(arches))
            except Exception as error:  # noqa: BLE001  the next demo still runs; Ctrl-C ends them all
                if debug:
                    traceback.print_exc()
                note(f"error: the {arch} demo: {error_line(error)}")
                worst = max(worst, exit_code(error))
    return worst


def sweep(config_path: Path, overrides: list[str], grid: list[str], concurrency: int | None, as_json: bool,
          debug: bool = False, server: EmbeddedServer | None = None, confirmed: bool = False,
          dry_run: bool = False, force: tuple[str, ...] = ()) -> int:
    """`lorapipe sweep`: every variant trained and evaluated over one encode, one line each; exit
    status 1 when any failed (after the others were published). More than sweep.max_variants only
    when `confirmed` (--yes); `dry_run`: list the variants, each a cache hit or not, and stop;
    `force` as `lorapipe run --force`."""
    from .run_plan import plan_run
    from .runlog import new_log_path, run_log
    from .sweep.flow import run_sweep
    from .sweep.grid import check_size, load_sweep, pinned_sweep, size_line
    from .sweep.slots import started_slots

    sweep = pinned_sweep(load_sweep(config_path, overrides, grid, concurrency))
    current().pipeline = sweep.base.name
    note(size_line(sweep))
    if not dry_run:
        check_size(sweep, confirmed, str(config_path))
    plan_run(sweep.base, ["encode"], None, list(force), note)  # what fails here is the command's only line
    if dry_run:
        if server:
            server.stop()
        return print_dry_run(sweep, as_json)
    note(f"sweeping {len(sweep.variants)} variants of pipeline {sweep.base.name!r} ({config_path}): starting Prefect")
    log_path = current().log = new_log_path(sweep.base.output_dir)
    # each slot's imports overlap Prefect's start and the encode; its variants train and evaluate in it
    with started_slots(sweep.base, min(sweep.settings.concurrency, trainings(sweep, force))) as slots:
        # overlapping Prefect's start, and done before the variants' threads evaluate side by side
        importing = import_model_code_ahead(sweep.base, frozenset({"encode", "evaluate"}))
        if server and server.connect():
            server.wait_ready()
        importing.join()
        with run_log(log_path, debug):
            done = run_sweep(sweep, force, slots)
    failed = [row for row in done["variants"] if row["error"]]
    if as_json:
        _print_json({**done, "pipeline": sweep.base.name, "shared_settings": sweep.shared, "log": str(log_path)})
    else:
        print_sweep(done, sweep.settings.metric, sweep.base.output_dir, log_path)
    for row in failed:
        note(f"error: variant {row['name']} failed: {row['error']}")
    return 1 if failed else 0


def print_sweep(done: dict, metric: str, output_dir: Path, log_path: Path) -> None:
    """One line per variant (its train and evaluate hit or computed, its score or its error), then where things are."""
    print(f"\n{'variant':<40}{'train':<10}{'evaluate':<10}{metric:>14}  folder")
    for row in done["variants"]:
        stages = {s["stage"]: s["status"] for s in row["stages"] or ()}
        outcome = f"{row['score']:.6g}" if row["score"] is not None else "-"
        print(f"{row['name']:<40}{stages.get('train', 'failed'):<10}{stages.get('evaluate', '-'):<10}{outcome:>14}"
              f"  {row['output_dir']}" + (f"\n{'':<4}{row['error']}" if row["error"] else ""))
    best = (f"{output_dir / 'best'} (variant {done['best']})" if done["best"]
            else f"none ({done['no_best']}; no {output_dir / 'best'} folder)")
    for label, where in (("best", best), ("report", done["report"]), ("run log", log_path)):
        print(f"{label + ':':<9}{where}")


def print_dry_run(sweep: Sweep, as_json: bool) -> int:
    """Each variant's train and evaluate as `lorapipe status` sees them (hit, or miss: it would
    run), reading the cache only."""
    rows = [{"name": variant.name, "overrides": variant.overrides, "output_dir": str(variant.config.output_dir),
             "train": standing.get("train"), "evaluate": standing.get("evaluate")}
            for variant, standing in zip(sweep.variants, variant_standings(sweep))]
    if as_json:
        _print_json({"pipeline": sweep.base.name, "shared_settings": sweep.shared, "variants": rows})
        return 0
    print(f"\n{'variant':<40}{'train':<10}{'evaluate':<10}folder")
    for row in rows:
        print(f"{row['name']:<40}{row['train'] or '-':<10}{row['evaluate'] or '-':<10}{row['output_dir']}")
    trainings = sum(row["train"] != "hit" for row in rows)
    print(f"dry run: {trainings} of {len(rows)} variants would train (the others are cache hits); nothing ran")
    return 0


def variant_standings(sweep: Sweep) -> list[dict[str, str]]:
    """Per variant, each stage's status as `lorapipe status` sees it (hit or miss), reading the cache only."""
    from .run_plan import plan_status

    return [{row["stage"]: row["status"] for row in (s.row() for s in plan_status(variant.config, note).standings)}
            for variant in sweep.variants]


def trainings(sweep: Sweep, force: tuple[str, ...]) -> int:
    """How many of the sweep's variants will train (all with `--force train`), as the cache says now."""
    if "train" in force:
        return len(sweep.variants)
    return sum(standing.get("train") != "hit" for standing in variant_standings(sweep))


def print_summary(config: PipelineConfig, summary: list[dict], log_path: Path, as_json: bool) -> int:
    """A run's stages (hit or computed, seconds, artifact) and where its outputs and log are."""
    from lorapipe.stages.sources.model_source import Source

    from .outputs import components_record, model_record, named_files

    model, components = model_record(config), components_record(config)
    if as_json:
        _print_json({"pipeline": config.name, "model": model, "components": components, "stages": summary,
                     "log": str(log_path)})
        return 0
    print(f"\n{'stage':<11}{'status':<10}{'seconds':>9}  artifact")
    for row in summary:
        print(f"{row['stage']:<11}{row['status']:<10}{row['seconds']:>9.1f}  {row['path']}")
        if row["stage"] == "encode" and row["info"]:
            print(f"{'':<21}{encode_counts(row['info'])}")
        if row["stage"] == "caption" and row["info"]:
            print(f"{'':<21}captions generated {row['info'].get('generated')}, reused {row['info'].get('reused')}")
        for repair in row["repairs"]:
            print(f"{'':<21}repaired while {repair['during']} ran ({repair['seconds']:.1f} s): "
                  f"{encode_counts(repair['info']) if row['stage'] == 'encode' else 'computed again'}")
    named = [("model", Source(**model)), *components.items(), *named_files(config.output_dir), ("run log", log_path)]
    width = max(13, *(len(label) + 2 for label, _ in named))
    for label, path in named:
        print(f"{label + ':':<{width}}{path}")
    return 0


def encode_counts(info: dict) -> str:
    """What an encode did, from its `info`."""
    return (f"latents encoded {info.get('latents_encoded')}, reused {info.get('latents_reused')}; "
            f"text embeddings encoded {info.get('texts_encoded')}, reused {info.get('texts_reused')}")


def status(config_path: Path, overrides: list[str], as_json: bool) -> int:
    from .run_plan import plan_status

    config = load_config(config_path, overrides)
    current().pipeline = config.name
    rows = [standing.row() for standing in plan_status(config, note).standings]
    if as_json:
        _print_json({"pipeline": config.name, "stages": rows})
    else:
        for row in rows:
            key = (row["key"] or "?")[:12]
            print(f"{row['stage']:<11}{row['status']:<6}{key:<14}{row['reason']}")
    return 0


def model(config_path: Path, overrides: list[str], as_json: bool) -> int:
    """The config's model: its family and, per component (the base's, or one set over it), its source,
    class, dtype, parameter count and the digest the stage keys use; read from configs and headers,
    no model loaded."""
    from lorapipe.stages.sources.inventory import describe

    from .steps import Context

    config = load_config(config_path, overrides)
    ctx = Context(config, log=note, reads_only=True)
    try:
        report = describe(ctx.base, ctx.declared_family, ctx.model_digests, ctx.converted_base, ctx.components)
    finally:
        ctx.close()
    if as_json:
        _print_json(report.to_json())
        return 0
    print(f"family: {report.family} ({report.label})" + (f", variant {report.variant}" if report.variant else ""))
    print(f"model:  {report.source}")
    width = max(len(c.class_name or "-") for c in report.components) + 2  # a class column as wide as its longest
    print(f"\n{'component':<16}{'class':<{width}}{'dtype':<10}{'parameters':>14}  {'digest':<14}source")
    for c in report.components:
        print(f"{c.name:<16}{c.class_name or '-':<{width}}{c.dtype or '-':<10}{c.parameters:>14,}  {c.digest[:12]:<14}"
              f"{c.source}")
    return 0


def _open_cache(args):
    """The store --config or --cache-dir names (a folder or an s3:// URL; default ./demo-run/cache)."""
    from lorapipe.cache.object_store import open_store
    from lorapipe.cache.objects import is_url, use_storage_options

    from .steps import object_settings

    if args.config:
        config = load_config(args.config)
        use_storage_options(config.storage_options)
        return open_store(config.cache_dir, object_settings(config), note)
    root = args.cache_dir or "demo-run/cache"
    if not is_url(root) and not Path(root).is_dir():
        raise UserError(f"cache folder {root} does not exist (pass --cache-dir or --config)")
    return open_store(root, log=note)


def _when(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp)) if timestamp else "-"


def cache_rows(store) -> list[dict]:
    """One row per artifact: stage, key, size, created, last used, the runs and pipelines that used it."""
    from lorapipe.cache.gc import last_used

    runs = [(pipeline, r) for pipeline, rows in store.runs().items() for r in rows]
    rows = []
    for a in store.artifacts():
        used_by = [r["run"] for _, r in runs if r["keys"].get(a.stage) == a.key]
        rows.append({"stage": a.stage, "key": a.key, "bytes": sum(e["size"] for e in a.manifest["files"].values()),
                     "created": a.manifest["created"], "last_used": last_used(store, a), "runs": used_by,
                     "pipelines": sorted({u["pipeline"] for u in store.uses(a)})})
    return rows


def _cache_ls(store, as_json: bool) -> int:
    rows = cache_rows(store)
    if as_json:
        _print_json(rows)
        return 0
    print(f"{'stage':<11}{'key':<14}{'bytes':>12}  {'created':<17} {'last used':<17} runs (pipelines)")
    for r in rows:
        runs = ", ".join(r["runs"][-3:]) + (f" +{len(r['runs']) - 3} more" if len(r["runs"]) > 3 else "")
        print(f"{r['stage']:<11}{r['key'][:12]:<14}{r['bytes']:>12,}  {_when(r['created']):<17} "
              f"{_when(r['last_used']):<17} {runs or '-'} ({','.join(r['pipelines']) or '-'})")
    return 0


def _cache_verify(store) -> int:
    """Re-hash every artifact, then every sample shard; a damaged shard is removed, so the encode
    artifacts that reference it are misses and its records are re-encoded on the next run."""
    bad, hashed = 0, {}
    for a in store.artifacts():
        problems = store.verify(a, hashed)
        bad += bool(problems)
        print(f"{a.stage:<11}{a.key[:12]:<14}{'ok' if not problems else 'DAMAGED: ' + problems[0]}")
    damaged = store.sample_store().verify()
    for shard, problem in damaged:
        print(f"{'shard':<11}{shard[:12]:<14}DAMAGED: {problem}; removed, its records are re-encoded on the next run")
    print(f"shards: {len(damaged)} damaged" if damaged else "shards: ok")
    return 1 if bad or damaged else 0


def _cache_rm(store, prefixes: list[str]) -> int:
    if not prefixes:
        raise UserError("cache rm needs one or more artifact keys (see `lorapipe cache ls`)")
    artifacts = list(store.artifacts())
    unmatched = [k for k in prefixes if not any(a.key.startswith(k) for a in artifacts)]
    if unmatched:
        raise UserError(f"cache rm: no artifact key starts with {unmatched[0]!r} (see `lorapipe cache ls`)")
    for a in artifacts:
        if any(a.key.startswith(k) for k in prefixes):
            store.remove(a, on_wait=lambda: print(f"{a.stage} {a.key[:12]}: a run is building from its work"
                                                  " directory; waiting for it", flush=True))
            print(f"removed {a.stage} {a.key}")
    return 0


def gc_cutoff(since: str | None, keep_days: float | None, keep_last: int) -> float | None:
    """The time after which anything used is kept: --since DATE, --keep-days D, or 30 days by default."""
    from datetime import datetime

    if since is not None and keep_days is not None:
        raise UserError("cache gc: give --since or --keep-days, not both")
    if since is not None:
        try:
            return datetime.fromisoformat(since).timestamp()
        except ValueError:
            raise UserError(f"cache gc: --since: {since!r} is not a date like 2026-11-01 or 2026-11-01T12:00") from None
    if keep_days is None and keep_last:
        return None
    return time.time() - (30 if keep_days is None else keep_days) * 86400


def cache(args) -> int:
    from lorapipe.cache.gc import collect

    store = _open_cache(args)
    if args.action != "ls":  # verify removes the shards it finds damaged
        store.ensure_usable()
    if args.action == "ls":
        return _cache_ls(store, args.json)
    if args.action == "verify":
        return _cache_verify(store)
    if args.action == "rm":
        return _cache_rm(store, args.keys)
    if args.keep_last < 0:
        raise UserError(f"cache gc: --keep-last must be 0 or more, got {args.keep_last}")
    freed = collect(store, keep_last=args.keep_last, keep_since=gc_cutoff(args.since, args.keep_days, args.keep_last))
    for name in freed.removed:
        print(f"removed {name}")
    print(f"gc: removed {len(freed.removed)} artifacts, {freed.shards} shards and {freed.work_dirs} work"
          f" directories, freed {freed.bytes:,} bytes")
    return 0


def captions_export(config_path: Path, overrides: list[str], folders: list[Path], overwrite: bool,
                    as_json: bool) -> int:
    """`lorapipe captions export`: the generated captions of the config's current caption artifact
    (found as `lorapipe status` finds it: its key, then the cache) as sidecars next to their images."""
    from lorapipe.stages.caption.export import export_captions

    config = load_config(config_path, overrides)
    if config.caption is None:
        raise UserError(f"{config_path} has no caption section, so no generated captions to export")
    datasets = tuple(d.with_defaults(caption_ext=config.preprocess.caption_ext) for d in config.data.sources)
    chosen = _datasets_in(datasets, folders)
    captions = _current_captions(config, config_path)
    captions = {**captions, "samples": {i: e for i, e in captions["samples"].items() if e["dataset"] in chosen}}
    written, skipped = export_captions(captions, datasets, overwrite)
    if as_json:
        _print_json({"written": [str(p) for p in written], "skipped": [vars(s) for s in skipped]})
        return 0
    for path in written:
        print(f"wrote    {path}")
    for s in skipped:
        print(f"skipped  {s.path}: {s.reason}")
    why = sorted(Counter(s.reason for s in skipped).items())
    print(f"{len(written)} caption file(s) written, {len(skipped)} skipped"
          + (f" ({'; '.join(f'{reason}: {n}' for reason, n in why)})" if why else ""))
    return 0


def _datasets_in(datasets: tuple[DatasetSource, ...], folders: list[Path]) -> set[str]:
    """The labels of the datasets at `folders` (all of them when none is given)."""
    if not folders:
        return {d.label for d in datasets}
    by_folder = {str(Path(d.path).resolve()): d.label for d in datasets if not isinstance(d.path, str)}
    unknown = [f for f in folders if str(f.resolve()) not in by_folder]
    if unknown:
        raise UserError(f"{unknown[0]} is not a dataset folder of this config (its local folders: "
                        f"{', '.join(sorted(by_folder)) or 'none'})")
    return {by_folder[str(f.resolve())] for f in folders}


def _current_captions(config: PipelineConfig, config_path: Path) -> dict:
    """captions.json of the caption artifact the config's current key names; a UserError when the
    cache has none (the run that makes it has not happened, or the config changed since)."""
    from lorapipe.stages.caption import CAPTIONS_FILE

    from .steps import Context
    from .runner import on_last_inputs, stand

    ctx = Context(config, log=note, reads_only=True)
    try:
        preprocess, caption = stand(ctx, ("preprocess", "caption"))
        artifact = caption.artifact
        if artifact is None and preprocess.artifact is None:  # the data changed: an earlier export's sidecars?
            artifact = on_last_inputs(ctx, "caption")
            if artifact is not None:
                note(f"the data changed since its captions were made (preprocess: {preprocess.reason}): exporting"
                     " the captions of this config's last run")
        if artifact is None:
            raise UserError(f"no captions of this config in the cache ({caption.reason}): run `lorapipe run"
                            f" {config_path} --only preprocess --only caption` first")
        return json.loads((artifact.path / CAPTIONS_FILE).read_text())
    finally:
        ctx.close()
