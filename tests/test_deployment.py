"""prefect.yaml against a real Prefect server, a real process worker and real runs of the tiny
demo, set up by docs/service.md's step-by-step commands as written: deploy without prompts, refuse
bad parameters, run, rerun (all Cached), grow the dataset (its own output folder), run twice at
once, retry and resume after the trainer is killed, watch training's progress live and cancel it,
and read the report in both Prefect UIs in headless Chromium. Everything started here is stopped by
PID.

    .venv/bin/python -m pytest tests/test_deployment.py -s    # the tests share one server, in order
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest
from browser import Chromium, stop
from prefect_server import PREFECT

from lorapipe.stages.processes.launching import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SERVICE_DOC = REPO / "docs" / "service.md"
WALKTHROUGH = "### Step by step: server, worker, first run"  # the section the fixture runs
STAGES = ["preprocess", "encode", "train", "evaluate"]
TRAINER = "lorapipe.stages.processes.jobs"  # in the command line of a training process: its job file names the test root
SMALL = {  # the demo, made quick: a few training steps, a small evaluation
    "train": {"max_steps": 6, "checkpoint_every": 3, "log_every": 2},
    "evaluate": {"prompts": ["a photo of a rocket on a launch pad"], "seeds": [0], "lora_scales": [1.0],
                 "num_inference_steps": 2},
}


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for name, value in changes.items():
        out[name] = merged(base[name], value) if isinstance(value, dict) and isinstance(base.get(name), dict) else value
    return out


def trainers(root: Path) -> list[psutil.Process]:
    """This test's training processes (other engineers' tests may be training on this machine too)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if TRAINER in cmdline and str(root) in cmdline:
            found.append(proc)
    return found


def assert_trainers_die(root: Path, what: str) -> None:
    """Within 30 s no training process of this test is left (any found are killed, then reported)."""
    deadline = time.time() + 30
    while trainers(root) and time.time() < deadline:
        time.sleep(0.5)
    left = [" ".join(p.cmdline()) for p in trainers(root)]
    for proc in trainers(root):
        proc.kill()
    assert not left, f"training processes outlived {what}: {left}"


@dataclass
class Service:
    url: str
    env: dict[str, str]
    root: Path
    base: dict[str, Any]  # the demo config as a deployment parameter
    run_command: list[str]  # the walk-through's `prefect deployment run ...`

    def config(self, changes: dict | None = None) -> dict:
        return merged(self.base, changes or {})

    def start_as_readme(self, config: dict) -> tuple[UUID, str]:
        """The walk-through's `prefect deployment run` with this config: the flow run's id and the URL it printed."""
        printed = prefect_cli({**self.env, "COLUMNS": "300"}, *self.run_command[1:], "--params",
                              json.dumps({"config": config}))
        return UUID(re.search(r"UUID: (\S+)", printed)[1]), re.search(r"URL: (\S+)", printed)[1]

    def start(self, deployment: str, **parameters: Any) -> UUID:
        from prefect.deployments import run_deployment

        return run_deployment(f"lorapipe/{deployment}", parameters=parameters, timeout=0).id

    def wait(self, run_id: UUID, timeout: float = 420) -> str:
        from prefect.client.orchestration import get_client

        deadline = time.time() + timeout
        with get_client(sync_client=True) as client:
            while time.time() < deadline:
                state = client.read_flow_run(run_id).state
                if state and state.is_final():
                    return state.name
                time.sleep(1)
        raise AssertionError(f"flow run {run_id} did not finish in {timeout} s:\n{self.logs(run_id)[-3000:]}")

    def run(self, deployment: str = "full", **parameters: Any) -> UUID:
        run_id = self.start(deployment, **parameters)
        state = self.wait(run_id)
        assert state == "Completed", f"run ended {state}:\n{self.logs(run_id)[-3000:]}"
        return run_id

    def task_states(self, run_id: UUID) -> dict[str, str]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        return {r.name.rsplit("-", 1)[0]: r.state_name for r in runs}

    def logs(self, run_id: UUID, expect: tuple[str, ...] = ()) -> str:
        """The run's log; waits up to 20 s for `expect` (the last lines reach the API after the
        run's final state)."""
        deadline = time.time() + 20
        while True:
            text = "\n".join(self._log_messages(run_id))
            if all(e in text for e in expect) or time.time() > deadline:
                return text
            time.sleep(1)

    def _log_messages(self, run_id: UUID) -> list[str]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        messages: list[str] = []
        with get_client(sync_client=True) as client:
            while True:  # the API answers 200 lines at a time
                page = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
                                        limit=200, offset=len(messages))
                messages += [log.message for log in page]
                if len(page) < 200:
                    return messages

    def progress(self, run_id: UUID, stage: str, other_than: str | None = None, timeout: float = 60) -> str:
        """The description of the run's progress artifact for `stage` (its latest log line), once
        it exists and differs from `other_than`."""
        deadline = time.time() + timeout
        while True:
            found = [a.description for a in self.artifacts(run_id)
                     if a.type == "progress" and a.description.startswith(f"{stage}:")]
            if found and found[0] != other_than:
                return found[0]
            assert time.time() < deadline, f"{stage} progress: {found or 'none'} after {timeout} s"
            time.sleep(0.5)

    def artifacts(self, run_id: UUID) -> list:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        with get_client(sync_client=True) as client:
            return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))


def run_summary(config: dict, deployment: str = "full") -> dict:
    """The run summary a run of `deployment` wrote into its own output folder."""
    return json.loads((Path(config["output_dir"]) / deployment / "run-summary.json").read_text())


def summary(config: dict, deployment: str = "full") -> dict[str, dict]:
    return {row["stage"]: row for row in run_summary(config, deployment)["stages"]}


def walkthrough() -> list[list[str]]:
    """The commands of docs/service.md's step-by-step walk-through, in order: the code lines of its
    numbered steps (indented 7 spaces), without comments."""
    text = SERVICE_DOC.read_text()
    assert WALKTHROUGH in text, f"docs/service.md has no {WALKTHROUGH!r} section: the service fixture runs its commands"
    section = text.split(WALKTHROUGH, 1)[1].split("\n#", 1)[0]
    code = [line.split("  #")[0].strip() for line in section.splitlines() if line.startswith(" " * 7)]
    return [shlex.split(line) for line in code if line]


def start_server(root: Path, env: dict[str, str], port: int, stack: ExitStack, command: list[str]) -> None:
    """The server on `port`, moved there by settings: with `--port` alone its UI calls the API on 4200."""
    log = open(root / "server.log", "w")
    server = subprocess.Popen([PREFECT, *command[1:]], stdout=log, stderr=subprocess.STDOUT,
                              env={**env, "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port)})
    stack.callback(stop, server, signal.SIGTERM)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert server.poll() is None, (root / "server.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError("the Prefect server did not answer in 120 s")


def prefect_cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([PREFECT, *args], cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def start_worker(root: Path, env: dict[str, str], api: str, command: list[str], stack: ExitStack) -> None:
    """Start the worker and wait until the server at `api` lists it in its pool (or fail with its log)."""
    log = open(root / "worker.log", "w")
    worker = subprocess.Popen([PREFECT, *command[1:]], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(stop, worker, signal.SIGINT)  # a worker ignores SIGTERM
    pool = command[command.index("--pool") + 1]
    deadline = time.time() + 60
    while time.time() < deadline and worker.poll() is None:
        request = urllib.request.Request(f"{api}/work_pools/{pool}/workers/filter",
                                         data=b"{}", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                if json.load(answer):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise AssertionError(f"`{shlex.join(command)}` did not join pool {pool}:\n{(root / 'worker.log').read_text()[-2000:]}")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """Server, pools, deployments and worker, by running docs/service.md's walk-through as written (on a
    free port instead of 4200; its `prefect deployment run` is what test_1 runs)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from lorapipe.flows.config import load_config
    from lorapipe.flows.demo import prepare_demo

    root = tmp_path_factory.mktemp("service")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PREFECT_API_", "PREFECT_UI_"))}
    env |= {"PREFECT_HOME": str(root / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PREFECT_WORKER_QUERY_SECONDS": "1"}
    base = load_config(prepare_demo(root / "demo", "sd15")).model_dump(mode="json")
    run_command = None
    with ExitStack() as stack:
        started = time.time()
        for command in walkthrough():
            if command[0] == "export":
                name, value = command[1].split("=", 1)
                env[name] = value.replace("127.0.0.1:4200", f"127.0.0.1:{port}")
            elif command[:3] == ["prefect", "server", "start"]:
                start_server(root, env, port, stack, command)
            elif command[:3] == ["prefect", "worker", "start"]:
                start_worker(root, env, f"{url}/api", command, stack)
            elif command[:3] == ["prefect", "deployment", "run"]:
                run_command = command
            else:
                prefect_cli(env, *command[1:])
        assert run_command, f"docs/service.md's {WALKTHROUGH!r} starts no run"
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}))
        print(f"\nThe walk-through: server, pools, deployments and worker up in {time.time() - started:.0f} s;"
              f" logs in {root}")
        yield Service(url, env, root, merged(base, SMALL), run_command)


def test_deployments_are_typed_scheduled_and_pull_from_the_repo(service):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
    assert set(deployments) == {"full", "retrain", "prepare", "train-gpu"}
    for d in deployments.values():
        # if the flow module fails to import, `prefect deploy` silently falls back to an untyped schema
        assert "PipelineConfig" in d.parameter_openapi_schema.get("definitions", {}), d.name
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    assert [s.schedule.cron for s in deployments["retrain"].schedules] == ["0 3 * * *"]
    assert deployments["retrain"].parameters["warm_start"] is False
    assert deployments["train-gpu"].work_pool_name == "lorapipe-gpu"


def test_bad_parameters_are_refused_before_a_run_is_created(service):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    def runs_of_full() -> int:  # the retrain schedule adds runs of its own meanwhile
        with get_client(sync_client=True) as client:
            return len(client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["full"]))))

    before = runs_of_full()
    bad = [({"config": service.config({"train": {"learning_rate": -1}})}, "config.train.learning_rate"),
           ({"config": service.config(), "only": ["trian"]}, "only[0]"),
           ({"config": service.config(), "start": "encoder"}, "start")]
    for parameters, field in bad:
        with pytest.raises(PrefectHTTPStatusError) as refused:
            service.start("full", **parameters)
        assert f"Validation failed for field '{field}'" in str(refused.value)
    assert runs_of_full() == before


def test_1_a_deployment_run_completes_with_lora_grid_report_and_artifacts(service):
    config = service.config()
    run_id, printed_url = service.start_as_readme(config)
    assert printed_url == f"{service.url}/runs/flow-run/{run_id}"  # the walk-through: "open the URL it prints"
    state = service.wait(run_id)
    assert state == "Completed", f"run ended {state}:\n{service.logs(run_id)[-3000:]}"
    out = Path(config["output_dir"]) / "full"  # a deployment run's own folder
    for name in ("pytorch_lora_weights.safetensors", "grid.png", "report.md", "run-summary.json"):
        assert (out / name).is_file(), name
    assert run_summary(config)["output_dir"] == str(out.resolve())
    assert {s: r["status"] for s, r in summary(config).items()} == dict.fromkeys(STAGES, "computed")
    expected = [f"{stage}: {what}" for stage in STAGES for what in ("miss (", "computed ")] + [f"outputs: {out}"]
    logs = service.logs(run_id, expect=tuple(expected))
    assert all(e in logs for e in expected), [e for e in expected if e not in logs]
    artifacts = service.artifacts(run_id)
    assert {a.key for a in artifacts if a.key} == {"demo-stages", "demo-report"}
    progress = {a.description.split(":")[0]: a for a in artifacts if a.type == "progress"}
    assert sorted(progress) == ["encode", "train"] and all(a.data == 100 for a in progress.values())
    assert re.match(r"encode: latents (\d+)/\1\b", progress["encode"].description), progress["encode"].description
    assert re.match(r"train: step 6/6 loss \d+\.\d+", progress["train"].description), progress["train"].description
    stages = next(a.data for a in artifacts if a.key == "demo-stages")
    assert "| train | computed |" in stages and str(out) in stages
    # diffusers imports bitsandbytes and torchao where installed, and they print their warnings on the worker's
    # terminal: the flow's process, which encodes and evaluates, hides them as `lorapipe run` does its own
    noise = [line for line in (service.root / "worker.log").read_text().splitlines()
             if re.search(r"bitsandbytes|torchao|gemm_4bit", line)]
    assert not noise, noise


def test_2_a_rerun_is_all_cache_hits_and_prepare_selects_two_stages(service):
    config = service.config()
    run_id = service.run("full", config=config)
    assert service.task_states(run_id) == dict.fromkeys(STAGES, "Cached")
    assert {s: r["status"] for s, r in summary(config).items()} == dict.fromkeys(STAGES, "hit")
    expected = tuple(f"{stage}: hit " for stage in STAGES)
    assert all(e in service.logs(run_id, expect=expected) for e in expected)
    prepared = service.run("prepare", config=config)  # stage selection: only preprocess and encode
    assert service.task_states(prepared) == {"preprocess": "Cached", "encode": "Cached"}


def test_2b_with_the_server_kept_a_cli_no_op_rerun_still_runs_the_flow_with_cached_states(service):
    """A `lorapipe run` pointed at a kept server (PREFECT_API_URL) runs its flow even when every stage
    is cached, so the run is watchable in the UI (without a server it runs none: tests/test_demo.py)."""
    import yaml
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    config = service.config({"output_dir": str(service.root / "cli-out")})
    (service.root / "cli.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "run", str(service.root / "cli.yaml"), "--json"],
                          cwd=REPO, env=service.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads(done.stdout)["stages"]
    assert [(s["status"], s["prefect_state"]) for s in stages] == [("hit", "Cached")] * 4
    assert "Beginning flow run" in done.stderr and "no Prefect flow ran" not in done.stderr
    flow_run = json.loads((service.root / "cli-out" / "run-summary.json").read_text())["flow_run"]
    with get_client(sync_client=True) as client:
        [recorded] = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run])))
    assert recorded.state_name == "Completed"
    deadline = time.time() + 20  # task runs reach the server as events, after the command's exit
    while service.task_states(recorded.id) != dict.fromkeys(STAGES, "Cached") and time.time() < deadline:
        time.sleep(1)
    assert service.task_states(recorded.id) == dict.fromkeys(STAGES, "Cached")


def test_3_new_images_are_encoded_alone_then_train_and_evaluate_rerun(service):
    from PIL import Image, ImageOps

    config = service.config()
    data = Path(config["data"]["path"])
    for name in ("rocket", "chelsea"):  # two new photos: mirror images, with their own captions
        ImageOps.mirror(Image.open(data / f"{name}.jpg")).save(data / f"{name}_mirrored.jpg", quality=95)
        (data / f"{name}_mirrored.txt").write_text((data / f"{name}.txt").read_text().strip() + ", mirrored\n")
    run_id = service.run("retrain", config=config)
    rows = summary(config, "retrain")
    assert {s: r["status"] for s, r in rows.items()} == dict.fromkeys(STAGES, "computed")
    assert {s: r["status"] for s, r in summary(config, "full").items()} == dict.fromkeys(STAGES, "hit"), \
        "the retrain overwrote the outputs of test_2's full run"
    assert run_summary(config, "retrain")["output_dir"] == str((Path(config["output_dir"]) / "retrain").resolve())
    assert rows["encode"]["info"]["latents_encoded"] == 2 and rows["encode"]["info"]["latents_reused"] == 8
    assert rows["encode"]["info"]["texts_encoded"] == 2
    assert "preprocess: miss (changed: inputs." in service.logs(run_id, expect=("preprocess: miss (changed",))


def test_4_two_runs_at_once_compute_each_stage_once(service):
    configs = [service.config({"preprocess": {"holdout_fraction": 0.375}, "output_dir": str(service.root / out)})
               for out in ("out-a", "out-b")]
    run_ids = [service.start("full", config=c) for c in configs]
    assert [service.wait(r) for r in run_ids] == ["Completed", "Completed"]
    rows = [summary(c) for c in configs]
    for stage in STAGES:
        assert sorted(r[stage]["status"] for r in rows) == ["computed", "hit"], stage
        assert rows[0][stage]["key"] == rows[1][stage]["key"]
    states = [service.task_states(r) for r in run_ids]
    for stage in STAGES:
        assert sorted(s[stage] for s in states) == ["Cached", "Completed"], stage
    verify = subprocess.run([sys.executable, "-m", "lorapipe.flows.cli", "cache", "verify", "--cache-dir",
                             configs[0]["cache_dir"]], cwd=REPO, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_5_a_killed_trainer_is_retried_by_prefect_and_resumes_from_its_checkpoint(service):
    config = service.config({"train": {"seed": 1, "max_steps": 24, "checkpoint_every": 4}})
    work = Path(config["cache_dir"]) / "work" / "train"
    earlier = set(work.iterdir())  # train keeps its work directories (for "train N more steps")
    run_id = service.start("full", config=config)
    deadline = time.time() + 300
    while not [c for c in work.glob("*/checkpoints/step-*") if c.parent.parent not in earlier]:
        assert time.time() < deadline, "no checkpoint was written in 300 s"
        time.sleep(0.2)
    children = [p for p in trainers(service.root) if "accelerate" not in " ".join(p.cmdline())]
    assert children, "the checkpoint exists but no training process was found"
    for proc in children:  # what the kernel's OOM killer would do
        proc.kill()
    assert service.wait(run_id) == "Completed"
    assert service.task_states(run_id) == {"preprocess": "Cached", "encode": "Cached", "train": "Completed",
                                           "evaluate": "Completed"}
    expected = ("WorkerCrashed", "died without reporting an error", "Retry 1/2")
    logs = service.logs(run_id, expect=expected)
    assert all(e in logs for e in expected), logs[-2000:]
    resumed = summary(config)["train"]["info"]["resumed_from"]
    assert resumed and resumed >= 4 and resumed % 4 == 0


def test_6_training_progress_shows_live_then_cancelling_leaves_no_training_process(service, chromium, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    config = service.config({"train": {"seed": 2, "max_steps": 100_000, "checkpoint_every": 100_000}})
    browser = Chromium(chromium, tmp_path / "chromium-profile")  # before the run: a cold start is slow on busy cores
    run_id = service.start("full", config=config)
    try:  # the page `prefect deployment run` prints, opened before training starts and never reloaded
        browser.call("Page.navigate", url=f"{service.url}/runs/flow-run/{run_id}")
        browser.click("#artifacts", "Artifacts")
        deadline = time.time() + 300
        while not any("accelerate" not in " ".join(p.cmdline()) for p in trainers(service.root)):
            assert time.time() < deadline, "training did not start in 300 s"
            time.sleep(0.5)
        first = service.progress(run_id, "train")
        assert re.match(r"train: step \d+/100000 loss \d+\.\d+", first), first
        assert service.progress(run_id, "train", other_than=first) != first  # moved in the API, mid-run
        step_shown = "(document.body.innerText.match(/train: step \\d+/) || [null])[0]"
        shown = browser.wait_for(step_shown)
        later = browser.wait_for(f"(() => {{ const s = {step_shown}; return s !== {json.dumps(shown)} && s; }})()")
        screenshot = browser.screenshot(service.root / "ui-live-progress.png")
        with get_client(sync_client=True) as client:
            running = client.read_flow_run(run_id).state.is_running()
    finally:
        browser.close()
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run_id, Cancelling())
    print(f"\nthe run page showed {shown!r}, then {later!r} without a reload: {screenshot}")
    assert running, "the run ended before its page showed the progress move"
    assert service.wait(run_id, timeout=120) == "Cancelled"
    assert_trainers_die(service.root, "the cancelled run")


def test_6b_a_flow_run_process_killed_outright_leaves_no_training_process(service):
    """SIGKILL (the worker's last resort after a cancel, or the OOM killer) runs no `finally`:
    the training processes must die with their parent anyway (PR_SET_PDEATHSIG)."""
    config = service.config({"train": {"seed": 3, "max_steps": 100_000, "checkpoint_every": 100_000}})
    run_id = service.start("full", config=config)
    deadline = time.time() + 300
    while not (started := trainers(service.root)):
        assert time.time() < deadline, "training did not start in 300 s"
        time.sleep(0.5)
    outermost = [p for p in started if p.parent().pid not in {q.pid for q in started}]  # accelerate's launcher with DDP
    flow_process = outermost[0].parent()
    assert "prefect.engine" in " ".join(flow_process.cmdline()), flow_process.cmdline()
    flow_process.kill()
    assert_trainers_die(service.root, "their SIGKILLed flow run process")
    assert service.wait(run_id, timeout=120) == "Crashed"


REPORT_IN = {  # the element holding a markdown artifact on its page, in each UI
    "classic": ".artifact-data-markdown",  # what the printed URL (/runs/flow-run/ID) opens
    "v2": "[data-testid=markdown-display]",  # what http://host:port/ opens by default in Prefect 3.8
}


def report_shown(box: str) -> str:
    """JavaScript: the report's images (once all loaded), tables and text, or null before."""
    return f"""(() => {{ const box = document.querySelector({json.dumps(box)});
        const images = box ? [...box.querySelectorAll("img")] : [];
        if (!images.length || !images.every(i => i.complete)) return null;
        return {{images: images.map(i => [i.alt, i.naturalWidth]), tables: box.querySelectorAll("table").length,
                 text: box.innerText, page: location.pathname}}; }})()"""


def test_7_the_report_shows_its_grid_chart_and_tables_in_both_prefect_uis(service, chromium, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        report = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["demo-report"])),
                                       sort=ArtifactSort.CREATED_DESC, limit=1)[0]
        run = client.read_flow_run(report.flow_run_id)
        out = Path(run.parameters["config"]["output_dir"]) / client.read_deployment(run.deployment_id).name
    shown = {}
    for ui, base in (("classic", service.url), ("v2", f"{service.url}/v2")):
        browser = Chromium(chromium, tmp_path / f"chromium-{ui}")
        try:  # as a user: the run's page, its Artifacts tab, the report's card
            browser.call("Page.navigate", url=f"{base}/runs/flow-run/{run.id}")
            browser.click("#artifacts, [role=tab]", "Artifacts")
            browser.click("a", "demo-report")
            if ui == "v2":  # the card opens every version of the key: pick this run's
                browser.click(f"a[href$='/artifacts/artifact/{report.id}']")
            shown[ui] = browser.wait_for(report_shown(REPORT_IN[ui]))
            screenshot = browser.screenshot(out / f"ui-report-{ui}.png")
        finally:
            browser.close()
        print(f"\nthe report in the {ui} UI: {screenshot}")
    for ui, page in shown.items():
        assert page["page"].endswith(f"/artifacts/artifact/{report.id}"), (ui, page["page"])
        assert [alt for alt, _ in page["images"]] == ["base and LoRA samples", "held-out loss by checkpoint"], ui
        assert all(width > 0 for _, width in page["images"]), (ui, page["images"])  # no broken image
        assert page["tables"] >= 3 and "Denoising loss" in page["text"] and "holdout" in page["text"], ui
