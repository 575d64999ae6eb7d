"""`lorapipe sweep`: a config's variants (grid, explicit ones, --grid) expanded, named and refused
as the design says (fast); and a sweep of 4 variants of the tiny model over one encode, through the
CLI and Prefect (slow): 4 trained and evaluated, the rerun all hits, one added value trains one,
a variant failing as it trains leaves the others published and best/ present."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml

from lorapipe.flows.cli import main
from lorapipe.flows.config import ConfigError, load_config
from lorapipe.flows.sweep.grid import load_sweep

pytestmark = pytest.mark.usefixtures("on_kept_prefect_server")  # its commands' flows: tests/prefect_server.py

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def sweep_config(folder: Path, **sweep) -> Path:
    """The demo preset with this `sweep:` section, in `folder`."""
    raw = yaml.safe_load(DEMO.read_text())
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({**raw, "sweep": sweep}, sort_keys=False))
    return path


def test_the_grid_is_a_cartesian_product_then_the_explicit_variants(tmp_path):
    path = sweep_config(tmp_path, grid={"train.learning_rate": [1e-4, 3e-4], "train.rank": [4, 16]},
                        variants=[{"train.rank": 8, "train.alpha": 8}, {"train.rank": 4, "train.learning_rate": 1e-4}])
    sweep = load_sweep(path)
    assert [v.name for v in sweep.variants] == [
        "learning_rate=0.0001,rank=4", "learning_rate=0.0001,rank=16", "learning_rate=0.0003,rank=4",
        "learning_rate=0.0003,rank=16", "rank=8,alpha=8"]  # the second explicit one is the grid's first
    base, last = sweep.base, sweep.variants[-1].config
    assert (last.train.rank, last.train.alpha, last.train.learning_rate) == (8, 8, base.train.learning_rate)
    assert last.output_dir == base.output_dir / "variants" / "rank=8,alpha=8"
    assert last.name == "demo.rank-8-alpha-8" and last.sweep is None
    changed = {"train", "output_dir", "name", "sweep"}
    assert last.model_dump(exclude=changed) == base.model_dump(exclude=changed)
    assert sweep.settings.metric == "holdout_loss" and sweep.settings.concurrency == 1


def test_cli_grid_replaces_a_key_or_adds_one_its_values_read_as_yaml(tmp_path):
    path = sweep_config(tmp_path, grid={"train.rank": [4, 16]})
    sweep = load_sweep(path, ["train.max_steps=7"], ["train.rank=2", "evaluate.num_inference_steps=3,5"], 2)
    assert [v.overrides for v in sweep.variants] == [{"train.rank": 2, "evaluate.num_inference_steps": 3},
                                                     {"train.rank": 2, "evaluate.num_inference_steps": 5}]
    assert [v.config.train.max_steps for v in sweep.variants] == [7, 7]
    assert sweep.settings.concurrency == 2


def test_grid_values_take_their_settings_types(tmp_path):
    path = sweep_config(tmp_path, grid={"train.learning_rate": ["3e-3"]}, variants=[{"train.learning_rate": "1e-3"}])
    sweep = load_sweep(path, [], ["train.rank=4,8.0"])
    assert [v.overrides for v in sweep.variants] == [{"train.learning_rate": 0.003, "train.rank": 4},
                                                     {"train.learning_rate": 0.003, "train.rank": 8},
                                                     {"train.learning_rate": 0.001}]
    assert [v.name for v in sweep.variants] == ["learning_rate=0.003,rank=4", "learning_rate=0.003,rank=8",
                                                "learning_rate=0.001"]


def test_sweeps_with_other_set_values_publish_into_other_folders(tmp_path):
    path = sweep_config(tmp_path, grid={"train.rank": [4]})
    plain, short, longer = (load_sweep(path, sets) for sets in ([], ["train.max_steps=7"], ["train.max_steps=9"]))
    assert short.shared == {"train.max_steps": 7} and plain.shared == {}
    folders = [s.variants[0].config.output_dir.name for s in (plain, short, longer)]
    assert folders == ["rank=4", "rank=4+train.max_steps=7", "rank=4+train.max_steps=9"]
    assert [s.variants[0].name for s in (plain, short, longer)] == ["rank=4"] * 3
    assert load_sweep(path, ["output_dir=elsewhere", "sweep.concurrency=2"]).shared == {}


def test_a_big_sweep_needs_yes_and_a_dry_run_lists_it(tmp_path, capsys):
    path = sweep_config(tmp_path, max_variants=3)
    assert main(["sweep", str(path), "--grid", "train.rank=1,2", "--grid", "train.alpha=1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "4 variants (grid 2 x 2): as many trainings" in err
    assert err.splitlines()[-1].endswith("the sweep has 4 variants, more than sweep.max_variants (3): give --yes to"
                                         " train them all, or --dry-run to list them")


def test_a_config_without_sweep_keeps_its_keys_and_dump():
    assert "sweep" not in load_config(DEMO).model_dump()


def test_names_use_whole_keys_where_last_segments_clash(tmp_path):
    path = sweep_config(tmp_path, grid={"train.cpu_threads": [1], "evaluate.cpu_threads": [1, 2]})
    assert [v.name for v in load_sweep(path).variants] == ["train.cpu_threads=1,evaluate.cpu_threads=1",
                                                           "train.cpu_threads=1,evaluate.cpu_threads=2"]


def test_a_value_with_a_slash_makes_a_folder_safe_name(tmp_path):
    path = sweep_config(tmp_path, variants=[{"evaluate.prompts": ["a/b"]}])
    assert [v.name for v in load_sweep(path).variants] == ["prompts=-a-b-"]


@pytest.mark.parametrize("sweep, grid, words", [
    ({"grid": {"preprocess.resolution": [64, 128]}}, [], ["sweep: preprocess.resolution", "allow_data_keys"]),
    ({"variants": [{"encode.flip": True}]}, [], ["sweep: encode.flip", "allow_data_keys"]),
    ({}, ["train.rank=4,-1"], ["sweep variant rank=-1", "train.rank"]),
    ({}, ["train.rnak=4"], ["sweep: train.rnak is not a config key; did you mean train.rank?"]),
    ({}, ["trainrank=4,8"], ["sweep: trainrank is not a config key; did you mean train.rank?"]),
    ({}, ["train.learning_rate=0.0005,5e-4"], ["sweep.grid train.learning_rate: 0.0005 and 5e-4 are the same"]),
    ({"grid": {"train.learning_rate": [0.0005, "5e-4"]}}, [], ["train.learning_rate: 0.0005 and 5e-4"]),
    ({"metric": "clip_score"}, ["train.rank=4,8"], ["sweep.metric: clip_score needs evaluate.clip_model"]),
    ({"metric": "beauty"}, ["train.rank=4"], ["sweep.metric", "beauty", "holdout_loss"]),
    ({}, [], ["nothing to sweep"]),
    ({}, ["train.rank"], ["--grid expects key=value1,value2"]),
    ({"grid": {"train.rank": []}}, [], ["sweep.grid", "train.rank: no values to try"]),
])
def test_a_bad_sweep_is_one_line_naming_the_key(tmp_path, sweep, grid, words):
    with pytest.raises(ConfigError) as err:
        load_sweep(sweep_config(tmp_path, **sweep), [], grid)
    assert all(word in str(err.value) for word in words) and "\n" not in str(err.value), str(err.value)


def test_data_keys_sweep_when_allowed(tmp_path):
    path = sweep_config(tmp_path, grid={"preprocess.resolution": [64, 128]}, allow_data_keys=True)
    assert [(v.config.preprocess.resolution, v.changes_data) for v in load_sweep(path).variants] == [(64, True),
                                                                                                      (128, True)]


def test_the_cli_refuses_a_data_key_in_one_line(tmp_path, capsys):
    assert main(["sweep", str(sweep_config(tmp_path)), "--grid", "encode.flip=true,false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lorapipe: error:") and "encode.flip" in err and "\n" not in err


# --- a real sweep of the tiny model through the CLI and Prefect (one module fixture) ---

RATES = ["0.0005", "0.001", "0.002", "0.004"]


def stage_counts(cache: Path) -> Counter:
    """Artifacts in the cache per stage: what was ever computed."""
    from lorapipe.cache.store import ArtifactStore

    return Counter(a.stage for a in ArtifactStore(cache).artifacts())


def statuses(done: dict, stage: str) -> dict[str, str]:
    """Per variant that ran: `stage`'s status."""
    return {row["name"]: {s["stage"]: s["status"] for s in row["stages"]}[stage]
            for row in done["variants"] if row["stages"]}


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, tiny_config):
    """Sweeps of one config (4 learning rates): the first (two variants at once), its rerun, one
    with a fifth rate and a variant whose init_lora is no LoRA file (it validates, and fails as
    train starts from it), a dry run of a known and a new rate with a shared --set value, and one
    whose only variant fails (no best); each as (exit code, its --json, stderr, the cache's artifacts per
    stage after it)."""
    from test_demo import lorapipe

    root = tmp_path_factory.mktemp("sweep")
    config = tiny_config(root, "sweep", max_steps=4, checkpoint_every=2, keep_checkpoints=1, log_every=2,
                         batch_size=2)
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "sweep": {"grid": {"train.learning_rate": [float(r) for r in RATES]}}}))
    (root / "not-a-lora.safetensors").write_bytes(b"not a safetensors file")
    runs = []
    for argv in (["--concurrency", "2"], [], ["--grid", f"train.learning_rate={','.join([*RATES, '0.008'])}",
                                               "--set", "sweep.variants=[{train.init_lora: not-a-lora.safetensors}]"],
                 ["--dry-run", "--grid", "train.learning_rate=5e-4,0.016", "--set", "train.max_steps=4"],
                 ["--set", "sweep.grid={}", "--set", "sweep.variants=[{train.init_lora: not-a-lora.safetensors}]"]):
        done = lorapipe("sweep", "config.yaml", "--json", *argv, cwd=root, prefect_home=root / "prefect")
        assert done.stdout, done.stderr[-3000:]
        runs.append((done.returncode, json.loads(done.stdout), done.stderr, stage_counts(root / "cache")))
        if (root / "out" / "best").is_dir():  # a later sweep replaces or removes it
            shutil.copytree(root / "out" / "best", best_after(root / "out", len(runs)))
    return root / "out", runs


def best_after(out: Path, sweep: int) -> Path:
    """A copy of out/best/ as the `sweep`th sweep (from 1) of the fixture left it."""
    return out.parent / f"best-after-{sweep}"


@pytest.mark.slow
def test_a_sweep_encodes_once_trains_and_evaluates_each_variant(sweeps):
    """Two variants at once, each slot's process started ahead training one variant after another:
    the last variant, its slot's second training, is the LoRA a run trains in a process of its own."""
    from test_demo import lorapipe

    out, [(code, done, stderr, counts), *_] = sweeps
    assert code == 0, stderr[-3000:]
    names = [f"learning_rate={rate}" for rate in RATES]
    assert [row["name"] for row in done["variants"]] == names
    assert counts == {"preprocess": 1, "encode": 1, "train": 4, "evaluate": 4}
    shared = {row["stage"]: row for row in done["shared"]}
    assert shared["encode"]["status"] == "computed" and shared["encode"]["info"]["latents_encoded"] == 8
    assert statuses(done, "train") == statuses(done, "evaluate") == dict.fromkeys(names, "computed")
    for row in done["variants"]:
        stages = {s["stage"]: s for s in row["stages"]}
        assert stages["encode"]["key"] == shared["encode"]["key"]  # the one encode serves every variant
        folder = out / "variants" / row["name"]
        assert Path(row["output_dir"]) == folder and row["error"] is None
        assert (folder / "pytorch_lora_weights.safetensors").is_file()
        holdout = json.loads((folder / "metrics.json").read_text())["loss"]["holdout"]["lora"]["overall"]
        assert row["score"] == holdout
    alone = lorapipe("run", "config.yaml", "--only", "train", "--force", "train", "--set", "output_dir=out-alone",
                     "--set", f"train.learning_rate={RATES[-1]}", cwd=out.parent, prefect_home=out.parent / "prefect")
    assert alone.returncode == 0, alone.stderr[-3000:]
    lora = "pytorch_lora_weights.safetensors"
    assert (out.parent / "out-alone" / lora).read_bytes() == (out / "variants" / names[-1] / lora).read_bytes()


@pytest.mark.slow
def test_the_best_variant_is_published_with_the_settings_that_made_it(sweeps):
    out, [_, _, (_, done, _, _), *_] = sweeps  # the third sweep's best: its failed variant has no score
    best = min((row for row in done["variants"] if row["score"] is not None), key=lambda row: row["score"])
    assert done["best"] == best["name"]
    best_dir = best_after(out, 3)
    chosen = json.loads((best_dir / "sweep-variant.json").read_text())
    assert chosen == {"name": best["name"], "overrides": best["overrides"], "shared_settings": {},
                      "metric": "holdout_loss", "score": best["score"]}
    variant = out / "variants" / best["name"]
    for name in ("pytorch_lora_weights.safetensors", "metrics.json", "grid.png"):
        assert (best_dir / name).read_bytes() == (variant / name).read_bytes(), name
    assert (best_dir / "run-summary.json").is_file() and Path(done["report"]) == out / "sweep-report.html"
    assert Path(done["report"]).is_file()


@pytest.mark.slow
def test_a_rerun_is_all_hits(sweeps):
    _, [(_, first, _, counts), (code, done, stderr, counts_after), *_] = sweeps
    assert code == 0, stderr[-3000:]
    assert counts_after == counts
    assert [row["status"] for row in done["shared"]] == ["hit", "hit"]
    assert set(statuses(done, "train").values()) == set(statuses(done, "evaluate").values()) == {"hit"}
    assert done["best"] == first["best"]


@pytest.mark.slow
def test_one_more_value_trains_one_and_a_failing_variant_leaves_the_others_published(sweeps):
    out, [_, (_, before, _, counts), (code, done, stderr, counts_after), *_] = sweeps
    failing = "init_lora=not-a-lora.safetensors"
    assert code == 1
    assert f"variant {failing} failed" in stderr.splitlines()[-1]
    rows = {row["name"]: row for row in done["variants"]}
    assert rows[failing]["error"] and rows[failing]["stages"] is None
    trained = statuses(done, "train")
    assert Counter(trained.values()) == {"hit": 4, "computed": 1} and trained["learning_rate=0.008"] == "computed"
    assert counts_after == {**counts, "train": 5, "evaluate": 5}
    for name, row in rows.items():
        summary = out / "variants" / name / "run-summary.json"
        assert json.loads(summary.read_text())["stages"] == row["stages"] if name != failing else not summary.exists()
    assert json.loads((best_after(out, 3) / "sweep-variant.json").read_text())["name"] == done["best"]
    assert done["best"] in trained and before["best"] in rows


@pytest.mark.slow
def test_a_sweep_down_max_steps_trains_each_and_force_trains_each_again(sweeps):
    """Over the sweeps' cache, max_steps 4 then 2 (issue 36): the shorter variant is step 2 of the
    longer one's training, which stays as it was published; then `--force train` trains both again
    and serves the shared stages from the cache."""
    from lorapipe.cache.store import ArtifactStore
    from lorapipe.stages.train.checkpoints import CheckpointDir
    from test_demo import lorapipe

    root = sweeps[0].parent
    argv = ["--json", "--grid", "train.learning_rate=0.003", "--grid", "train.max_steps=4,2",
            "--set", "train.keep_checkpoints=2", "--set", "output_dir=out-steps"]

    def sweep(*extra: str) -> dict:
        done = lorapipe("sweep", "config.yaml", *argv, *extra, cwd=root, prefect_home=root / "prefect")
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    first = sweep()
    longer, shorter = ("learning_rate=0.003,max_steps=4", "learning_rate=0.003,max_steps=2")
    assert statuses(first, "train") == {longer: "computed", shorter: "computed"}
    rows = {row["name"]: {s["stage"]: s for s in row["stages"]} for row in first["variants"]}
    assert rows[shorter]["train"]["info"]["resumed_from"] == 2  # the longer training's step 2 is its result
    published = Path(rows[longer]["train"]["path"])
    manifest = json.loads((published / "manifest.json").read_text())
    work = ArtifactStore(root / "cache").work_dir("train", manifest["work_key"])
    assert CheckpointDir(work / "checkpoints").steps() == [2, 4] and not (work / "shorter").exists()
    for step in ("step-000002", "step-000004"):
        lora = f"checkpoints/{step}/pytorch_lora_weights.safetensors"
        assert (work / lora).read_bytes() == (published / lora).read_bytes()
    assert (work / "logs" / "loss.jsonl").read_bytes() == (published / "logs" / "loss.jsonl").read_bytes()
    forced = sweep("--force", "train")
    assert [row["status"] for row in forced["shared"]] == ["hit", "hit"]
    assert statuses(forced, "train") == {longer: "computed", shorter: "computed"}
    assert {row["name"]: {s["stage"]: s["reason"] for s in row["stages"]}["train"]
            for row in forced["variants"]} == {longer: "forced", shorter: "forced"}


@pytest.mark.slow
def test_a_dry_run_lists_hits_and_trainings_and_trains_nothing(sweeps):
    out, [*_, (_, _, _, counts), (code, done, stderr, counts_after), _] = sweeps
    assert code == 0, stderr[-3000:]
    assert counts_after == counts and done["shared_settings"] == {"train.max_steps": 4}
    assert [(row["overrides"], row["train"]) for row in done["variants"]] == [
        ({"train.learning_rate": 0.0005}, "hit"), ({"train.learning_rate": 0.016}, "miss")]
    assert Path(done["variants"][0]["output_dir"]) == out / "variants" / "learning_rate=0.0005+train.max_steps=4"
    assert "2 variants (grid 2): as many trainings" in stderr


@pytest.mark.slow
def test_a_sweep_without_a_best_removes_the_earlier_best(sweeps):
    out, [*_, (code, done, stderr, _)] = sweeps
    assert code == 1 and done["best"] is None and done["no_best"] == "every variant failed"
    assert best_after(out, 4).is_dir() and not (out / "best").exists()
    assert "no best: every variant failed, so no best/ folder" in (out / "sweep-report.html").read_text()
