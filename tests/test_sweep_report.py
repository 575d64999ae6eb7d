"""The sweep's report (flows/sweep/report.py) over real `lorapipe run` output folders of the tiny
demo at two learning rates and step counts (scored by a tiny CLIP too), beside a variant whose run
failed: the best by each metric as the files say, a failed variant shown with its line and never
best, a missing metric None; and, in a real Chromium, the page shows every variant's grid and marks
the best row."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from lorapipe.flows.sweep.outcome import VariantOutcome
from lorapipe.flows.sweep.report import METRICS, REPORT_HTML, best_variant, score, write_sweep_report

pytestmark = pytest.mark.usefixtures("on_kept_prefect_server")  # its commands' flows: tests/prefect_server.py

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"learning_rate=0.0001": {"train.learning_rate": 0.0001},
            "learning_rate=0.02,max_steps=6": {"train.learning_rate": 0.02, "train.max_steps": 6}}
FAILING = {"train.learning_rate": -1}


def lorapipe_run(root: Path, overrides: dict, out: Path, clip: Path) -> subprocess.CompletedProcess:
    settings = {**overrides, "output_dir": out, "evaluate.clip_model": clip}
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    return subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "run", str(root / "config.yaml"), *sets],
                          cwd=REPO, env={**os.environ, "PREFECT_HOME": str(root / "prefect-home")},
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, tiny_config, tiny_clip) -> list[VariantOutcome]:
    """Each variant a `lorapipe run` of the tiny demo config (one cache: encoded once) into its own
    folder, as a sweep lays them out, then one whose run failed (its last line its error)."""
    root = tmp_path_factory.mktemp("sweep")
    tiny_config(root, "sweep", max_steps=4, checkpoint_every=2, keep_checkpoints=2, log_every=2, batch_size=2)
    found = []
    for name, overrides in VARIANTS.items():
        done = lorapipe_run(root, overrides, root / "variants" / name, tiny_clip)
        assert done.returncode == 0, done.stderr[-3000:]
        found.append(VariantOutcome(name, overrides, root / "variants" / name))
    failed = lorapipe_run(root, FAILING, root / "variants" / "learning_rate=-1", tiny_clip)
    assert failed.returncode != 0
    return [*found, VariantOutcome("learning_rate=-1", FAILING, root / "variants" / "learning_rate=-1",
                                   failed.stderr.strip().splitlines()[-1])]


def metrics_of(outcome: VariantOutcome) -> dict:
    return json.loads((outcome.output_dir / "metrics.json").read_text())


def with_clip_score(folder: Path, outcome: VariantOutcome, clip_score: dict) -> VariantOutcome:
    """The variant's metrics.json with another CLIP score (the tiny CLIP's random weights score every
    image 0, as CLIPScore clips a negative similarity), in `folder`."""
    folder.mkdir()
    (folder / "metrics.json").write_text(json.dumps({**metrics_of(outcome), "clip_score": clip_score}))
    return VariantOutcome(folder.name, outcome.overrides, folder)


@pytest.mark.slow  # over whole `lorapipe run`s
def test_the_best_variant_has_the_lowest_held_out_loss_its_files_hold(outcomes, tmp_path):
    trained = outcomes[:2]
    held_out = {o.name: metrics_of(o)["loss"]["holdout"]["lora"]["overall"] for o in trained}
    on_train = {o.name: metrics_of(o)["loss"]["train"]["lora"]["overall"] for o in trained}
    clip = {o.name: max(metrics_of(o)["clip_score"]["lora"].values()) for o in trained}  # over evaluate.lora_scales
    assert len(set(held_out.values())) == 2  # the two learning rates give two LoRAs
    assert {o.name: score(o, "holdout_loss") for o in trained} == held_out
    assert best_variant(outcomes, "holdout_loss").name == min(held_out, key=held_out.get)
    assert best_variant(outcomes, "train_loss").name == min(on_train, key=on_train.get)
    assert {o.name: score(o, "clip_score") for o in trained} == clip
    top = next(o for o in trained if clip[o.name] == max(clip.values()))  # the first of equals
    assert best_variant(outcomes, "clip_score") is top
    low = with_clip_score(tmp_path / "low", trained[0], {"base": 1.0, "lora": {"1.0": 30.0}})
    high = with_clip_score(tmp_path / "high", trained[0], {"base": 1.0, "lora": {"0.5": 31.0, "1.0": 29.0}})
    assert score(high, "clip_score") == 31.0 and best_variant([low, high], "clip_score") is high  # higher is better
    assert not METRICS["holdout_loss"][1] and METRICS["clip_score"][1]  # higher is better for CLIP only
    with pytest.raises(ValueError, match="sweep.metric: 'fid' is not one of holdout_loss, train_loss, clip_score"):
        score(trained[0], "fid")


@pytest.mark.slow  # over whole `lorapipe run`s
def test_a_failed_variant_is_never_best_and_a_missing_metric_is_none(outcomes, tmp_path):
    best, failed = best_variant(outcomes, "holdout_loss"), outcomes[2]
    other = next(o for o in outcomes[:2] if o is not best)
    assert failed.error.startswith("lorapipe: error: ") and "train.learning_rate" in failed.error
    assert score(failed, "holdout_loss") is None
    failed_with_files = VariantOutcome("failed late", best.overrides, best.output_dir, "evaluate: out of memory")
    assert score(failed_with_files, "holdout_loss") is None  # its files are not a result
    assert best_variant([failed_with_files, *outcomes], "holdout_loss") is best
    shown = write_sweep_report([failed_with_files], tmp_path / "failed", "holdout_loss")
    assert "| failed: evaluate: out of memory | - | - | - | - |" in shown.markdown  # not its earlier run's losses
    assert "no sample grid (failed: evaluate: out of memory)" in shown.html.read_text()
    unevaluated = VariantOutcome("unevaluated", {}, tmp_path)  # a folder without metrics.json
    assert score(unevaluated, "holdout_loss") is None
    assert best_variant([unevaluated, failed], "holdout_loss") is None
    unscored = with_clip_score(tmp_path / "without-clip", other, {"skipped": "no clip_model configured"})
    assert score(unscored, "clip_score") is None and score(unscored, "holdout_loss") == score(other, "holdout_loss")
    assert best_variant([unscored, failed], "clip_score") is None


@pytest.mark.slow  # over whole `lorapipe run`s
def test_the_report_tables_every_variant_with_its_curves_and_grids(outcomes, tmp_path):
    report = write_sweep_report(outcomes, tmp_path, "holdout_loss")
    best = best_variant(outcomes, "holdout_loss")
    page = report.html.read_text()
    assert report.html == tmp_path / REPORT_HTML and [p.name for p in tmp_path.iterdir()] == [REPORT_HTML]
    lines = report.markdown.splitlines()
    assert lines[2] == (f"3 variants (1 failed); metric holdout_loss (lower is better); best: {best.name}"
                        f" (holdout_loss {score(best, 'holdout_loss'):.5f}).")
    header, rows = lines[4], {line.split(" | ")[1]: line for line in lines[6:9]}
    assert header == ("| best | variant | train.learning_rate | train.max_steps | status | holdout_loss"
                      " | held-out loss, base | held-out loss, LoRA | held-out loss by checkpoint | CLIP score, LoRA |")
    assert rows[best.name].startswith(f"| \u2605 best | {best.name} |")
    assert f"| failed: {outcomes[2].error} |" in rows["learning_rate=-1"]
    assert "| 0.0001 |  | ok |" in rows["learning_rate=0.0001"]  # max_steps not set: an empty cell
    for outcome in outcomes[:2]:
        assert rows[outcome.name].endswith(f" | {score(outcome, 'clip_score'):.5f} |")
        checkpoints = json.loads((outcome.output_dir / "checkpoint_losses.json").read_text())["checkpoints"]
        assert "; ".join(f"step {c['step']}: {c['overall']:.5f}" for c in checkpoints) in rows[outcome.name]
        log = (outcome.output_dir / "logs" / "loss.jsonl").read_text().splitlines()  # published with the LoRA
        steps = outcome.overrides.get("train.max_steps", 4)
        assert [json.loads(line)["step"] for line in log] == list(range(1, steps + 1))
    assert page.count('<img src="data:image/png;base64,') == 2 and "<script" not in page and "http:" not in page
    assert page.count("<polyline") == 2 + 2 + 1  # training curves, checkpoint losses, the base model's
    assert f'<tr class="best" data-variant="{best.name}">' in page and 'class="failed"' in page


@pytest.mark.slow  # over whole `lorapipe run`s
def test_the_page_shows_every_grid_and_marks_the_best_in_chromium(outcomes, chromium, tmp_path):
    from browser import Chromium

    report = write_sweep_report(outcomes, tmp_path, "holdout_loss")
    browser = Chromium(chromium, tmp_path / "chromium-sweep")
    try:
        browser.call("Page.navigate", url=report.html.as_uri())
        shown = browser.wait_for("""(() => { const images = [...document.querySelectorAll("img[data-variant]")];
            if (!images.length || !images.every(i => i.complete && i.naturalWidth > 0)) return null;
            document.querySelector(".grids").scrollIntoView();
            const box = e => { const b = e.getBoundingClientRect(); return [b.x, b.y, b.width, b.height]; };
            const best = document.querySelector("tr.best");
            return {scale: window.devicePixelRatio, best: best.dataset.variant,
                    charts: [...document.querySelectorAll("svg")].map(s => s.getBoundingClientRect().width),
                    grids: Object.fromEntries(images.map(i => [i.dataset.variant, box(i)]))}; })()""")
        shot = Image.open(io.BytesIO(browser.screenshot(tmp_path / "sweep.png").read_bytes())).convert("RGB")
        browser.call("Runtime.evaluate", expression="window.scrollTo(0, 0)")
        top = browser.wait_for("(() => { const b = document.querySelector('tr.best').cells[0].getBoundingClientRect();"
                               " return b.y < innerHeight ? [b.x, b.y, b.width, b.height] : null; })()")
        table_shot = Image.open(io.BytesIO(browser.screenshot(tmp_path / "table.png").read_bytes())).convert("RGB")
    finally:
        browser.close()
    assert shown["best"] == best_variant(outcomes, "holdout_loss").name
    assert shown["charts"] == [720, 720]
    assert sorted(shown["grids"]) == sorted(VARIANTS)
    grids = {o.name: Image.open(o.output_dir / "grid.png").convert("RGB") for o in outcomes[:2]}
    for name, (x, y, w, h) in shown["grids"].items():
        grid = grids[name]
        seen = shot.crop(tuple(round(v * shown["scale"]) for v in (x, y, x + w, y + h))).resize(grid.size)
        for at in telling_pixels(grid, grids):
            colours = seen.getpixel(at), grid.getpixel(at)
            assert max(abs(a - b) for a, b in zip(*colours)) < 24, (name, at, *colours)
    x, y, w, h = top
    marked = table_shot.getpixel((round((x + 2) * shown["scale"]), round((y + h / 2) * shown["scale"])))
    assert marked == (255, 243, 176)  # the best row's background


def telling_pixels(grid: Image.Image, grids: dict[str, Image.Image]) -> list[tuple[int, int]]:
    """Pixels of `grid` that tell it from the other grids (where they differ most), and a spread of others."""
    from PIL import ImageChops

    difference = [ImageChops.difference(grid, other).convert("L") for other in grids.values() if other is not grid]
    spread = [(grid.width * i // 7, grid.height * j // 5) for i in range(1, 7) for j in range(1, 5)]
    differing = sorted(((difference[0].getpixel((px, py)), (px, py)) for px in range(grid.width)
                        for py in range(grid.height)), reverse=True)[:8] if difference else []
    return spread + [at for _, at in differing]


def test_a_long_training_curve_is_averaged_over_bins_of_steps(tmp_path):
    from lorapipe.flows.sweep.scores import CURVE_POINTS, training_curve

    log = tmp_path / "loss.jsonl"
    log.write_text("".join(json.dumps({"step": step, "loss": step % 2, "lr": 1e-4}) + "\n" for step in range(1, 1001)))
    curve = training_curve(log)
    assert len(curve) <= CURVE_POINTS and curve[0] == (2.5, 0.5) and curve[-1] == (998.5, 0.5)
    assert training_curve(tmp_path / "none.jsonl") == []


def scored_folder(folder: Path, lora: float) -> VariantOutcome:
    """A variant's output folder as evaluate leaves it with one checkpoint (at its last step, 4)."""
    (folder / "logs").mkdir(parents=True)
    losses = {"base": {"overall": 0.5}, "lora": {"overall": lora}}
    (folder / "metrics.json").write_text(json.dumps({"loss": {"holdout": losses, "train": losses}}))
    (folder / "checkpoint_losses.json").write_text(json.dumps({"base": 0.5, "checkpoints": [{"step": 4,
                                                                                              "overall": lora}]}))
    (folder / "logs" / "loss.jsonl").write_text("".join(json.dumps({"step": s, "loss": lora}) + "\n" for s in (1, 4)))
    return VariantOutcome(folder.name, {"train.learning_rate": lora}, folder)


def test_a_one_checkpoint_sweep_shows_the_base_line_and_a_long_error_fits_the_window(chromium, tmp_path):
    from browser import Chromium

    long_path = "/".join(["a_folder_with_a_rather_long_name"] * 12) + "/pytorch_lora_weights.safetensors"
    outcomes = [scored_folder(tmp_path / "rate=0.4", 0.4), scored_folder(tmp_path / "rate=0.3", 0.3),
                VariantOutcome("rate=-1", {"train.learning_rate": -1}, tmp_path / "none",
                               f"train.init_lora: {long_path} is not a LoRA file")]
    report = write_sweep_report(outcomes, tmp_path / "out", "holdout_loss")
    browser = Chromium(chromium, tmp_path / "chromium-narrow")
    try:
        browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", url=report.html.as_uri())
        shown = browser.wait_for("""(() => { const table = document.querySelector("table");
            const base = [...document.querySelectorAll("polyline")].find(l => l.textContent === "base model");
            if (!table || !base) return null;
            return {page: document.documentElement.scrollWidth, table: table.getBoundingClientRect().right,
                    base: base.getBoundingClientRect().width}; })()""")
    finally:
        browser.close()
    assert shown["page"] <= 1280 and shown["table"] <= 1280, shown
    assert shown["base"] > 100, shown  # a line across the chart, not a point at step 4
