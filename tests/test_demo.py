"""`lorapipe demo` end to end through Prefect's embedded mode, twice: the second run is all cache
hits and recomputes nothing; with no Prefect server kept running it runs no Prefect flow at all,
and a run with something to build does."""
from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import FEWER_STEPS, LIBRARY_WARNINGS_SHOWN, LOADED_AT_EXIT, copy_model

pytestmark = pytest.mark.slow


def lorapipe(*args: str, cwd: Path, prefect_home: Path | None = None,
             report_loaded: bool = False, timeout: float = 900) -> subprocess.CompletedProcess:
    """report_loaded: the last line of stderr names the model libraries the command's process loaded."""
    env = {**os.environ, **LIBRARY_WARNINGS_SHOWN, "PREFECT_HOME": str(prefect_home or cwd / "prefect-home")}
    entry = ["-c", LOADED_AT_EXIT] if report_loaded else ["-m", "lorapipe.flows.cli"]
    return subprocess.run([sys.executable, *entry, *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@dataclass(frozen=True)
class DemoPart:
    """One family's demo in a `lorapipe demo` with several --arch: its lines of the command's output."""
    stdout: str
    stderr: str

    def error(self) -> str | None:
        """Its one error line, if it failed."""
        return next((line for line in self.stderr.splitlines() if line.startswith("lorapipe: error: ")), None)


def several_demos(arches: list[str], root: Path, *settings: str, report_loaded: bool = False,
                  ) -> tuple[subprocess.CompletedProcess, dict[str, DemoPart]]:
    """`lorapipe demo --arch A --arch B ... --workdir .` (FEWER_STEPS, then `settings`) run from ROOT:
    each family's demo in ROOT/ARCH, in one command; the command and each demo's part of its output."""
    command = lorapipe("demo", *(word for arch in arches for word in ("--arch", arch)), "--workdir", ".",
                       *FEWER_STEPS, *settings, cwd=root, report_loaded=report_loaded, timeout=300 * len(arches))
    parts = [demo_parts(output, prefix) for output, prefix in ((command.stdout, ""), (command.stderr, "lorapipe: "))]
    return command, {arch: DemoPart(parts[0].get(arch, ""), parts[1].get(arch, "")) for arch in arches}


def demo_parts(output: str, prefix: str) -> dict[str, str]:
    """The output split at each demo's heading line (flows/demo.py demo_heading), by arch."""
    pieces = re.split(rf"^{prefix}demo \d+ of \d+: (\S+) in .*$", output, flags=re.MULTILINE)
    return dict(zip(pieces[1::2], pieces[2::2]))


def demos_on_tiny_models(arches: list[str], root: Path, tiny_models, *settings: str,
                         ) -> tuple[subprocess.CompletedProcess, dict[str, DemoPart]]:
    """several_demos, each ROOT/ARCH holding a copy of the session's tiny model of ARCH first (as
    demo_on_tiny_model)."""
    for arch in arches:
        copy_model(tiny_models(arch), root / arch / "model")
    return several_demos(arches, root, *settings)


def demo_on_tiny_model(arch: str, workdir: Path, tiny_models, *settings: str) -> subprocess.CompletedProcess:
    """`lorapipe demo --arch ARCH --workdir WORKDIR` (FEWER_STEPS, then `settings`) run from WORKDIR's parent,
    WORKDIR holding a copy of the session's tiny model of ARCH, which the demo then trains instead of
    building its own (the same bytes: the SD demo's runs below cover building it)."""
    copy_model(tiny_models(arch), workdir / "model")
    return lorapipe("demo", "--arch", arch, "--workdir", workdir.name, *FEWER_STEPS, *settings, cwd=workdir.parent)


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("demo")
    first = lorapipe("demo", "--workdir", "run", cwd=cwd)
    assert first.returncode == 0, first.stderr[-3000:]
    summary_first = json.loads((cwd / "run" / "outputs" / "run-summary.json").read_text())
    second = lorapipe("demo", "--workdir", "run", cwd=cwd)
    assert second.returncode == 0, second.stderr[-3000:]
    summary_second = json.loads((cwd / "run" / "outputs" / "run-summary.json").read_text())
    return cwd / "run", first, summary_first, summary_second


def test_demo_writes_the_lora_grid_and_metrics_and_says_where(demo_runs):
    run, first, summary, _ = demo_runs
    outputs = run / "outputs"
    for name in ("pytorch_lora_weights.safetensors", "grid.png", "metrics.json", "run-summary.json"):
        assert (outputs / name).is_file()
        assert str(outputs / name) in first.stdout
    assert [s["status"] for s in summary["stages"]] == ["computed"] * 4


def test_the_terminal_shows_no_library_note_that_tells_the_user_nothing(demo_runs):
    """Encode, train and evaluate ran in the process started ahead, whose output the terminal shows
    (stages/processes/library_notes.py)."""
    first = demo_runs[1]
    assert "evaluate: in the process started ahead" in first.stderr
    for note in ("No LoRA keys associated to", "requires torchvision"):
        assert note not in first.stdout + first.stderr


def test_demo_lora_beats_the_base_model_on_its_training_samples(demo_runs):
    metrics = json.loads((demo_runs[0] / "outputs" / "metrics.json").read_text())
    train = metrics["loss"]["train"]
    assert train["lora"]["overall"] < train["base"]["overall"]


def test_second_demo_run_is_all_cached(demo_runs):
    _, _, first, second = demo_runs
    assert [s["status"] for s in second["stages"]] == ["hit"] * 4
    assert [s["prefect_state"] for s in second["stages"]] == [None] * 4  # served without a flow (see below)
    assert [s["key"] for s in second["stages"]] == [s["key"] for s in first["stages"]]
    assert all(s["info"] == {} for s in second["stages"])  # a hit encodes and trains nothing
    assert first["stages"][1]["info"]["latents_encoded"] == 8


def flow_runs(prefect_home: Path) -> list[str]:
    """The names of the flow runs recorded in the database of Prefect's temporary server."""
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return [name for (name,) in db.execute("SELECT name FROM flow_run")]


def test_an_all_cached_rerun_runs_no_prefect_flow_yet_writes_outputs_and_records_the_run(demo_runs):
    """With no Prefect server kept running, a rerun whose every stage is a hit skips the temporary
    server and the flow (a run nobody could watch), yet writes what the flow writes: the outputs,
    run-summary.json, the run log, and the run in the cache's records for `cache gc --keep-last`."""
    from lorapipe.cache.store import ArtifactStore

    run = demo_runs[0]
    home = run.parent / "prefect-home"  # the demo_runs' Prefect home
    flows_before, runs_before = flow_runs(home), ArtifactStore(run / "cache").runs()["demo"]
    shutil.rmtree(run / "outputs")
    again = lorapipe("demo", "--workdir", "run", "--json", cwd=run.parent)
    assert again.returncode == 0, again.stderr[-3000:]
    stages = json.loads(again.stdout)["stages"]
    assert [(s["status"], s["prefect_state"]) for s in stages] == [("hit", None)] * 4
    assert "Beginning flow run" not in again.stderr
    assert again.stderr.splitlines()[-1].startswith("lorapipe: every stage was cached, so no Prefect flow ran")
    assert flow_runs(home) == flows_before

    for name in ("pytorch_lora_weights.safetensors", "grid.png", "metrics.json", "report.md"):
        assert (run / "outputs" / name).is_file(), name
    summary = json.loads((run / "outputs" / "run-summary.json").read_text())
    assert summary["stages"] == stages and summary["flow_run"] is None and summary["run"].startswith("cached-")
    runs = ArtifactStore(run / "cache").runs()["demo"]
    assert runs[:-1] == runs_before
    assert runs[-1]["run"] == summary["run"] and runs[-1]["keys"] == {s["stage"]: s["key"] for s in stages}
    log = Path(json.loads(again.stdout)["log"]).read_text()
    assert all(f"{stage}: hit " in log for stage in ("preprocess", "encode", "train", "evaluate"))

    only_train = lorapipe("run", "run/demo.yaml", "--only", "train", "--json", cwd=run.parent)
    assert only_train.returncode == 0, only_train.stderr[-3000:]  # the stages before train are walked, evaluate is not
    assert [s["stage"] for s in json.loads(only_train.stdout)["stages"]] == ["preprocess", "encode", "train"]
    assert flow_runs(home) == flows_before


def test_a_rerun_with_a_stage_to_build_or_forced_runs_the_flow_as_before(demo_runs):
    """A miss, or a cached stage given to --force, is built by the Prefect flow on the temporary server.
    Its Prefect home is two folders deep in folders not made yet (as the demo's own is, in a fresh
    workdir): Prefect makes only the last folder of its home, where its server's database lives, and
    such a home once failed the run with 'unable to open database file'."""
    run = demo_runs[0]
    home = run.parent / "not-yet" / "made" / "prefect"
    seed_1 = ["run", "run/demo.yaml", "--only", "preprocess", "--set", "preprocess.seed=1", "--json"]
    for n, argv in enumerate((seed_1, [*seed_1, "--force", "preprocess"]), 1):  # a miss, then cached but forced
        built = lorapipe(*argv, cwd=run.parent, prefect_home=home)
        assert built.returncode == 0, built.stderr[-3000:]
        [stage] = json.loads(built.stdout)["stages"]
        assert (stage["status"], stage["prefect_state"]) == ("computed", "Completed")
        assert "Beginning flow run" in built.stderr and "no Prefect flow ran" not in built.stderr
        assert (home / "prefect.db").is_file() and len(flow_runs(home)) == n


def test_a_machine_that_only_joins_a_training_never_skips_the_flow(demo_runs):
    """On train.machine_rank > 0 the flow joins rank 0's training and records no run: a rerun there
    is never served without the flow, even when every stage is cached."""
    from lorapipe.flows.cached_run import all_cached_run
    from lorapipe.flows.config import load_config
    from lorapipe.flows.run_plan import plan_run

    joining = ["train.num_machines=2", "train.num_processes=2", "train.machine_rank=1",
               "train.main_process_ip=127.0.0.1"]  # train's key changes (num_processes), preprocess's does not
    config = load_config(demo_runs[0] / "demo.yaml", joining)
    assert all_cached_run(config, plan_run(config, ["preprocess"], None, [], print)) is None


def test_status_says_hit_or_miss_and_which_ingredient_changed(demo_runs, capsys):
    """In pytest's own process: status runs no flow, and cli.main serves in-process callers."""
    from lorapipe.flows.cli import main

    def status(*argv: str) -> str:
        assert main(["status", str(demo_runs[0] / "demo.yaml"), *argv]) == 0
        return capsys.readouterr().out

    assert [s["status"] for s in json.loads(status("--json"))["stages"]] == ["hit"] * 4
    rows = {s["stage"]: s for s in json.loads(status("--json", "--set", "train.learning_rate=0.001"))["stages"]}
    assert rows["encode"]["status"] == "hit"
    assert rows["train"]["status"] == "miss" and rows["train"]["reason"] == "changed: params.learning_rate"
    assert rows["evaluate"]["status"] == "miss" and rows["evaluate"]["key"] is None
    assert "params.learning_rate" in status("--set", "train.learning_rate=0.001")
