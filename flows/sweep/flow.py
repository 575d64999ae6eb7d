"""The sweep's Prefect flow: preprocess [caption] encode once (the pipeline's own tasks), then each
variant's train + evaluate as one mapped task, at most `concurrency` at once (a thread pool: the
training itself runs in a process of its own, evaluation here, one at a time), each publishing
into its own folder as `lorapipe run` does. A variant that fails is reported and the others go on;
each resumes on its own (its train key is its own). Then the comparison report and the best
variant's files in best/."""
from __future__ import annotations

import threading
from dataclasses import replace

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic.json_schema import SkipJsonSchema

from lorapipe.cache.errors import one_line, user_message

from ..artifacts import artifact_key
from ..config import PipelineConfig
from ..pipeline import DatasetStages, Done, dataset_stages, evaluate, published, train
from ..steps import config_stages
from ..run_plan import plan_flow
from .best import publish_best, withdraw_best
from .grid import Sweep, Variant
from .outcome import VariantOutcome
from .report import score, write_sweep_report
from .slots import WarmSlots

# One evaluation at a time in this process: two diffusers loads side by side in threads failed with
# "Cannot copy out of meta tensor" (a model is built empty through a process-wide patch of torch,
# accelerate's init_empty_weights).
EVALUATING = threading.Lock()


def run_sweep(sweep: Sweep, force: tuple[str, ...] = (), slots: WarmSlots | None = None) -> dict:
    """The sweep's flow, at most sweep.settings.concurrency variants at once, each in a process of
    `slots` when one is idle; what it did (`sweep_flow`'s return)."""
    runner = ThreadPoolTaskRunner(max_workers=sweep.settings.concurrency)
    return sweep_flow.with_options(task_runner=runner)(sweep.base, sweep.variants, sweep.settings.metric,
                                                       sweep.shared, force, slots)


@flow(name="lorapipe-sweep", log_prints=True, validate_parameters=False)
def sweep_flow(config: PipelineConfig, variants: SkipJsonSchema[tuple[Variant, ...]], metric: str,
               shared_settings: dict, force: tuple[str, ...] = (),
               slots: SkipJsonSchema[WarmSlots | None] = None) -> dict:
    """Train and evaluate each of `variants` over one encode of `config`'s data; report them by
    `metric` (with the `shared_settings` every variant has) and publish the best; `force`: the
    stages to rebuild (`--force`), the shared ones once; `slots`: the processes started ahead that
    the variants' stages run in (none: each training in a process of its own). Returns {"shared":
    the shared stages' rows, "variants": per variant its name, overrides, output_dir, error, score and stages' rows,
    "best": its name or None, "no_best": why there is none}."""
    stages = config_stages(config)
    shared_stages = stages[: stages.index("encode") + 1]
    data = dataset_stages(config, plan_flow(config, list(shared_stages), None, list(force)))
    futures = run_variant.map(variants, unmapped(data), unmapped(force), unmapped(slots or WarmSlots()))
    finished = [(v, *variant_outcome(v, future)) for v, future in zip(variants, futures)]
    outcomes = [outcome for _, outcome, _ in finished]
    report = write_sweep_report(outcomes, config.output_dir, metric, shared_settings)
    create_markdown_artifact(report.markdown, key=artifact_key(config.name, "sweep"),
                             description=f"the sweep's variants compared; {report.html}")
    best = report.best
    if best:
        publish_best(best, next(v.config for v in variants if v.name == best.name), config.output_dir / "best",
                     metric, score(best, metric), shared_settings, get_run_logger().info)
    else:
        withdraw_best(config.output_dir / "best", report.no_best, get_run_logger().warning)
    rows = [{**vars(outcome), "score": score(outcome, metric), "stages": stages} for _, outcome, stages in finished]
    return {"shared": [d.result.to_json() for d in data if d], "variants": rows, "best": best.name if best else None,
            "no_best": report.no_best, "report": str(report.html)}


@task(name="variant", task_run_name="variant {variant.name}", cache_policy=NO_CACHE, persist_result=False)
def run_variant(variant: Variant, shared: DatasetStages, force: tuple[str, ...], slots: WarmSlots) -> list[dict]:
    """Train and evaluate `variant` over the shared stages (its own where it changes them), in an
    idle process of `slots`, and publish it into its folder; its summary's rows. `force` rebuilds
    those of its stages it runs itself."""
    config = variant.config
    with slots.taken() as warm:
        plan = plan_flow(config, [], None, list(force), warm)
        data = dataset_stages(config, plan) if variant.changes_data else DatasetStages(*map(own_copy, shared))
        lora = train(config, plan, data.enc, False)
        with EVALUATING:
            scores = evaluate(config, plan, data.dataset, data.enc, lora)
    return published(config, config.output_dir, [*data, lora, scores])


def own_copy(done: Done | None) -> Done | None:
    """A shared stage's Done whose result this variant's publishing may write into (its outputs)."""
    return replace(done, result=replace(done.result)) if done else None


def variant_outcome(variant: Variant, future: PrefectFuture) -> tuple[VariantOutcome, list[dict] | None]:
    """Its outcome, and its summary's rows (None when it failed: its error says why, in one line)."""
    try:
        rows = future.result()
    except Exception as error:  # noqa: BLE001  one variant's failure never stops the sweep
        line = user_message(error) or f"{type(error).__name__}: {one_line(str(error))}"
        get_run_logger().error(f"variant {variant.name}: failed: {line}")
        return VariantOutcome(variant.name, variant.overrides, variant.config.output_dir, line), None
    return VariantOutcome(variant.name, variant.overrides, variant.config.output_dir), rows
