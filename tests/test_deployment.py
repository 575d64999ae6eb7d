"""prefect.yaml against a real Prefect server, a real process worker and real runs of the tiny
demo: deploy without prompts, refuse bad parameters, run, rerun (all Cached), grow the dataset,
run twice at once, retry and resume after the trainer is killed, cancel during training, and look at the
run's page in headless Chromium. Everything started here is stopped by PID.

    .venv/bin/python -m pytest tests/test_deployment.py -s    # the tests share one server, in order
"""
from __future__ import annotations

import json
import os
import signal
import socket
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

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STAGES = ["preprocess", "encode", "train", "evaluate"]
TRAINER = "stages.train.recipe"
SMALL = {  # the demo, made quick: a few training steps, a small evaluation
    "train": {"max_steps": 6, "checkpoint_every": 3, "log_every": 2},
    "evaluate": {"prompts": ["a photo of a rocket on a launch pad"], "seeds": [0], "lora_scales": [1.0],
                 "num_inference_steps": 2},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for name, value in changes.items():
        out[name] = merged(base[name], value) if isinstance(value, dict) and isinstance(base.get(name), dict) else value
    return out


def stop(process: subprocess.Popen, sig: int, grace: float = 20) -> None:
    """Send `sig` to the process, then kill whatever of it and its descendants is left."""
    if process.poll() is not None:
        return
    family = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(sig)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for child in family:
        if child.is_running():
            child.kill()


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

    def config(self, changes: dict | None = None) -> dict:
        return merged(self.base, changes or {})

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

    def artifacts(self, run_id: UUID) -> list:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        with get_client(sync_client=True) as client:
            return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))


def summary(config: dict) -> dict[str, dict]:
    rows = json.loads((Path(config["output_dir"]) / "run-summary.json").read_text())["stages"]
    return {row["stage"]: row for row in rows}


def start_server(root: Path, env: dict[str, str], port: int, stack: ExitStack) -> None:
    log = open(root / "server.log", "w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
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


def prefect_cli(env: dict[str, str], *args: str) -> None:
    done = subprocess.run([PREFECT, *args], cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.config import load_config
    from flows.demo import prepare_demo

    root = tmp_path_factory.mktemp("service")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect-home"), "PREFECT_API_URL": f"{url}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_UI_API_URL": f"{url}/api"}
    base = load_config(prepare_demo(root / "demo")).model_dump(mode="json")
    with ExitStack() as stack:
        started = time.time()
        start_server(root, env, port, stack)
        for pool in ("lorapipe-process", "lorapipe-gpu"):  # no GPU here: lorapipe-gpu only gets deployed to
            prefect_cli(env, "work-pool", "create", pool, "--type", "process", "--overwrite")
        prefect_cli(env, "--no-prompt", "deploy", "--all")
        worker_log = open(root / "worker.log", "w")
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "lorapipe-process"], cwd=root, env=env,
                                  stdout=worker_log, stderr=subprocess.STDOUT)
        stack.callback(stop, worker, signal.SIGINT)  # a worker ignores SIGTERM
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: f"{url}/api"}))
        print(f"\nserver, pools, deployments and worker up in {time.time() - started:.0f} s; logs in {root}")
        yield Service(url, env, root, merged(base, SMALL))


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
    run_id = service.run("full", config=config)
    out = Path(config["output_dir"])
    for name in ("pytorch_lora_weights.safetensors", "grid.png", "report.md", "run-summary.json"):
        assert (out / name).is_file(), name
    assert {s: r["status"] for s, r in summary(config).items()} == dict.fromkeys(STAGES, "computed")
    expected = [f"{stage}: {what}" for stage in STAGES for what in ("miss (", "computed ")]
    logs = service.logs(run_id, expect=tuple(expected))
    assert all(e in logs for e in expected), [e for e in expected if e not in logs]
    artifacts = service.artifacts(run_id)
    assert {a.key for a in artifacts if a.key} == {"demo-stages", "demo-report"}
    progress = sorted(a.description for a in artifacts if a.type == "progress" and a.data == 100)
    assert progress == ["encode progress", "train progress"]
    assert "| train | computed |" in next(a.data for a in artifacts if a.key == "demo-stages")


def test_2_a_rerun_is_all_cache_hits_and_prepare_selects_two_stages(service):
    config = service.config()
    run_id = service.run("full", config=config)
    assert service.task_states(run_id) == dict.fromkeys(STAGES, "Cached")
    assert {s: r["status"] for s, r in summary(config).items()} == dict.fromkeys(STAGES, "hit")
    expected = tuple(f"{stage}: hit " for stage in STAGES)
    assert all(e in service.logs(run_id, expect=expected) for e in expected)
    prepared = service.run("prepare", config=config)  # stage selection: only preprocess and encode
    assert service.task_states(prepared) == {"preprocess": "Cached", "encode": "Cached"}


def test_3_new_images_are_encoded_alone_then_train_and_evaluate_rerun(service):
    from PIL import Image, ImageOps

    config = service.config()
    data = Path(config["data"]["path"])
    for name in ("rocket", "chelsea"):  # two new photos: mirror images, with their own captions
        ImageOps.mirror(Image.open(data / f"{name}.jpg")).save(data / f"{name}_mirrored.jpg", quality=95)
        (data / f"{name}_mirrored.txt").write_text((data / f"{name}.txt").read_text().strip() + ", mirrored\n")
    run_id = service.run("retrain", config=config)
    rows = summary(config)
    assert {s: r["status"] for s, r in rows.items()} == dict.fromkeys(STAGES, "computed")
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
    verify = subprocess.run([sys.executable, "-m", "flows.cli", "cache", "verify", "--cache-dir",
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


def test_6_cancelling_during_training_leaves_no_training_process(service):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    config = service.config({"train": {"seed": 2, "max_steps": 100_000, "checkpoint_every": 100_000}})
    run_id = service.start("full", config=config)
    deadline = time.time() + 300
    while not any("accelerate" not in " ".join(p.cmdline()) for p in trainers(service.root)):
        assert time.time() < deadline, "training did not start in 300 s"
        time.sleep(0.5)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Cancelling())
    assert service.wait(run_id, timeout=120) == "Cancelled"
    assert_trainers_die(service.root, "the cancelled run")


def test_6b_a_flow_run_process_killed_outright_leaves_no_training_process(service):
    """SIGKILL (the worker's last resort after a cancel, or the OOM killer) runs no `finally`:
    the training processes must die with their parent anyway (PR_SET_PDEATHSIG)."""
    config = service.config({"train": {"seed": 3, "max_steps": 100_000, "checkpoint_every": 100_000}})
    run_id = service.start("full", config=config)
    deadline = time.time() + 300
    while not (launchers := [p for p in trainers(service.root) if "accelerate" in " ".join(p.cmdline())]):
        assert time.time() < deadline, "training did not start in 300 s"
        time.sleep(0.5)
    flow_process = launchers[0].parent()
    assert "prefect.engine" in " ".join(flow_process.cmdline()), flow_process.cmdline()
    flow_process.kill()
    assert_trainers_die(service.root, "their SIGKILLed flow run process")
    assert service.wait(run_id, timeout=120) == "Crashed"


class Chromium:
    """Headless Chromium driven over the DevTools protocol (no browser download, no extra package)."""

    def __init__(self, profile: Path):
        self.process = subprocess.Popen([str(CHROMIUM), *CHROMIUM_FLAGS, "--window-size=1400,1000",
                                         f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, deadline = profile / "DevToolsActivePort", time.time() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.time() < deadline and self.process.poll() is None, "chromium did not start"
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json") as answer:
            page = next(t for t in json.load(answer) if t["type"] == "page")
        from websockets.sync.client import connect

        self.socket, self.calls = connect(page["webSocketDebuggerUrl"], max_size=None), 0

    def call(self, method: str, **params: Any) -> dict:
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:  # events arrive in between; the answer carries our id
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == self.calls:
                assert "error" not in message, message
                return message["result"]

    def wait_for(self, expression: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while not self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value"):
            assert time.time() < deadline, f"the page never satisfied {expression}"
            time.sleep(0.5)

    def close(self) -> None:
        self.socket.close()
        stop(self.process, signal.SIGTERM, grace=10)


def test_7_the_run_page_shows_the_report_artifact_in_chromium(service, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent: `apt-get install -y chromium` (what .ci/run does) to check the UI")
    import base64

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        finished = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(name=FlowRunFilterStateName(any_=["Completed"]))),
            sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    page = f"{service.url}/runs/flow-run/{finished.id}"
    browser = Chromium(tmp_path / "chromium-profile")
    try:
        browser.call("Page.navigate", url=page)
        browser.wait_for("document.getElementById('artifacts') !== null")  # the run page's tab bar
        browser.call("Runtime.evaluate", expression="document.getElementById('artifacts').click()")
        browser.wait_for("document.body.innerText.includes('demo-report')")
        browser.wait_for(f"document.body.innerText.includes({finished.name!r})")
        screenshot = tmp_path / "flow-run-artifacts.png"
        screenshot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    finally:
        browser.close()
    print(f"\nscreenshot of {page} (Artifacts tab): {screenshot}")
    assert screenshot.stat().st_size > 10_000
