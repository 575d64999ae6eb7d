"""Where the time goes between typing `lorapipe run` and the first training step.

The demo job (the tiny SD1.x model, the 8 bundled photos, 64 px, batch 4, 200 steps) through
`python -m lorapipe.flows.cli run ... --only preprocess --only encode --only train`, three ways per round:

- fresh: an empty cache: preprocess, encode and train computed (also encode_stage: the encode
  stage's own seconds, from run-summary.json);
- train: `--force train` with encode cached: the start-up a user waits through when retraining;
- noop: the same again with nothing to do (without a kept server it runs no Prefect flow: its
  only phase is then the total);
- fresh_home (only when chosen with `--case`): `--only preprocess --force preprocess` (a cached
  stage forced, so that the flow runs: a run with every stage cached runs none) on a PREFECT_HOME
  made new for the run, as every new demo workdir and every test has: the temporary server's
  database is created then (the migrations, or the copy of lorapipe's database
  template: flows/prefect_db.py). The template, in an XDG_CACHE_HOME of the benchmark's own, is
  written by an untimed run before the rounds;
- fresh_encode (only when chosen with `--case`): fresh, `--only preprocess --only encode`: no
  training process started ahead, so the command's own process alone (encode_stage as in fresh);
- fresh_all (only when chosen with `--case`): fresh, every stage (evaluate too, as `make demo`):
  its total and evaluate_stage, the evaluate stage's own seconds;
- with `--kept-server`, train and noop again (every version) with a Prefect server kept running
  between commands (`prefect server start`, PREFECT_API_URL pointing at it), as docs/service.md's "Fast
  repeated runs" says.

Each output line (stdout and stderr of the whole process tree) is stamped when it arrives, and the
phases are the gaps between lines every version prints (`phases_of`), so a slow moment of this shared
machine moves one phase in one run, not the comparison. `--baseline DIR` runs another checkout's
code (e.g. `git archive main | tar -x -C DIR`) in the same rounds, interleaved with this one;
`--compare CMD` runs a command in the same rounds too (diffusers' train_text_to_image_lora.py on
the same model and photos: BENCHMARKS.md has the exact command), its first step read from its tqdm
bar. `{model}`, `{images}` and `{out}` in CMD are replaced by the tiny model, an imagefolder copy of
the photos (metadata.jsonl) and an empty output folder.

    python -m benchmarks.startup_bench [--rounds 3] [--steps 200] [--baseline DIR] [--compare CMD] [--kept-server]
                                       [--case fresh|train|noop|fresh_home|fresh_encode|fresh_all]...
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator

from .common import ResultsSection

REPO = Path(__file__).resolve().parent.parent
DEMO_IMAGES = REPO / "stages" / "assets" / "demo_images"
STEPS = 200
STEP_1 = "the first row of loss.jsonl"  # written after step 1 by every version, whatever log_every says
CASES = ("fresh", "train", "noop", "fresh_home", "fresh_encode", "fresh_all")


def run_args(steps: int, evaluate: bool = False) -> list[str]:
    stages = [] if evaluate else ["--only", "preprocess", "--only", "encode", "--only", "train"]
    return [*stages, "--set", f"train.max_steps={steps}", "--set", f"train.checkpoint_every={steps}"]


def phases_of(steps: int) -> tuple:
    """(phase, the line or event that ends it); a phase whose end is missing is left out."""
    return (
        ("start_to_flow", re.compile(r"Beginning flow run")),
        ("flow_to_train_launch", re.compile(r"train: \d+ process\(es\)")),
        ("launch_to_child_line", re.compile(r"rank 0/\d+: ")),
        ("child_line_to_step_1", STEP_1),
        ("steps", re.compile(rf"\bstep {steps}/{steps}\b")),
        ("steps_to_exit", None),  # the process's exit
    )


NOOP_PHASES = (("start_to_flow", re.compile(r"Beginning flow run")), ("flow_to_exit", None))
COMPARE_FIRST_STEP = re.compile(r"Steps:.*\b1/\d+ \[")  # tqdm's bar in diffusers' example scripts


def stamped_lines(command: list[str] | str, cwd: Path, env: dict,
                  events: dict[str, Callable[[], bool]] | None = None) -> tuple[list[tuple[float, str]], float, int]:
    """Run `command`; every line (split at \\n and at tqdm's \\r) with the seconds since the start
    at which it arrived, and each of `events` (checked every 10 ms) as a line of its name when it
    first held; the total seconds; the exit code."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, shell=isinstance(command, str),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, pending, waiting = [], b"", dict(events or {})
    while True:
        readable, _, _ = select.select([process.stdout], [], [], 0.01)
        now = time.perf_counter() - started
        for name in [name for name, happened in waiting.items() if happened()]:
            lines.append((now, name))
            del waiting[name]
        if not readable:
            continue
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        *complete, pending = re.split(rb"[\r\n]", pending + chunk)
        lines += [(now, line.decode(errors="replace")) for line in complete if line.strip()]
    code = process.wait()
    total = time.perf_counter() - started
    if pending.strip():
        lines.append((total, pending.decode(errors="replace")))
    return lines, total, code


def first(lines: list[tuple[float, str]], end: re.Pattern | str) -> float | None:
    if isinstance(end, str):
        return next((t for t, line in lines if line == end), None)
    return next((t for t, line in lines if end.search(line)), None)


def phases(lines: list[tuple[float, str]], total: float, ends: tuple) -> dict[str, float]:
    """Seconds of each phase whose end was seen, the command's start to step 1, and the total."""
    row, previous = {}, 0.0
    for name, end in ends:
        at = total if end is None else first(lines, end)
        if at is None:
            continue
        row[name] = round(at - previous, 2)
        previous = at
    step_1 = first(lines, STEP_1)
    if step_1 is not None:
        row["start_to_step_1"] = round(step_1, 2)
    row["total"] = round(total, 2)
    return row


class Job:
    """The demo job's files under `root`, for one checkout's code."""

    def __init__(self, root: Path, code: Path, steps: int):
        self.root, self.code, self.steps = root, code, steps
        sys.path.insert(0, str(REPO))
        from lorapipe.flows.demo import prepare_demo

        self.config = prepare_demo(root, "sd15")
        self.env = {**os.environ, "PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                    "PREFECT_HOME": str(root / "prefect"), "XDG_CACHE_HOME": str(root / "xdg-cache")}
        self.env.pop("PREFECT_API_URL", None)  # Prefect's embedded server, as a plain `lorapipe run`

    def run(self, *extra: str, ends: tuple | None = None, api_url: str | None = None,
            stages: list[str] | None = None, prefect_home: Path | None = None) -> dict[str, float]:
        stages = stages or run_args(self.steps)
        command = [sys.executable, "-m", "lorapipe.flows.cli", "run", str(self.config), *stages, *extra]
        env = {**self.env, "PREFECT_API_URL": api_url} if api_url else self.env
        env = {**env, "PREFECT_HOME": str(prefect_home)} if prefect_home else env
        started = time.time()
        lines, total, code = stamped_lines(command, self.code, env, {STEP_1: lambda: self._stepped(started)})
        if code != 0:
            raise RuntimeError(f"{shlex.join(command)} exited with {code}:\n" + "\n".join(l for _, l in lines[-20:]))
        return phases(lines, total, ends or phases_of(self.steps))

    def _stepped(self, since: float) -> bool:
        logs = (self.root / "cache" / "work" / "train").glob("*/logs/loss.jsonl")
        return any(s.st_size and s.st_mtime >= since for s in (log.stat() for log in logs))

    def fresh(self, stages: list[str] | None = None, ends: tuple | None = None) -> dict[str, float]:
        for name in ("cache", "outputs"):
            shutil.rmtree(self.root / name, ignore_errors=True)
        return {**self.run(ends=ends, stages=stages), "encode_stage": self.stage_seconds("encode")}

    def stage_seconds(self, stage: str) -> float:
        """The stage's own seconds in the last run, as its summary (run-summary.json) records them."""
        summary = json.loads(next((self.root / "outputs").rglob("run-summary.json")).read_text())
        return next(s["seconds"] for s in summary["stages"] if s["stage"] == stage)

    def fresh_home(self) -> dict[str, float]:
        home = self.root / "prefect-fresh"
        shutil.rmtree(home, ignore_errors=True)
        return self.run(ends=NOOP_PHASES, stages=["--only", "preprocess", "--force", "preprocess"], prefect_home=home)

    def case(self, name: str) -> dict[str, float]:
        return {"fresh": self.fresh, "train": lambda: self.run("--force", "train"),
                "noop": lambda: self.run(ends=NOOP_PHASES), "fresh_home": self.fresh_home,
                "fresh_encode": lambda: self.fresh(["--only", "preprocess", "--only", "encode"], NOOP_PHASES),
                "fresh_all": lambda: {**self.fresh(run_args(self.steps, evaluate=True)),
                                      "evaluate_stage": self.stage_seconds("evaluate")}}[name]()


@contextmanager
def kept_server(job: Job) -> Iterator[str]:
    """A Prefect server on 127.0.0.1 for the whole measurement, in the job's PREFECT_HOME; its API URL."""
    from lorapipe.flows.server import api_answers
    from lorapipe.stages.processes.launching import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port), "--no-ui"], env=job.env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while not api_answers(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server start on port {port} did not answer")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def imagefolder(root: Path) -> Path:
    """The demo photos as a datasets imagefolder (file_name + text in metadata.jsonl)."""
    folder = root / "imagefolder"
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for image in sorted(DEMO_IMAGES.glob("*.jpg")):
        shutil.copyfile(image, folder / image.name)
        rows.append(json.dumps({"file_name": image.name, "text": image.with_suffix(".txt").read_text().strip()}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def compare_run(template: str, root: Path, model: Path, steps: int) -> dict[str, float]:
    out = root / "compare-out"
    shutil.rmtree(out, ignore_errors=True)
    command = template.format(model=model, images=imagefolder(root), out=out)
    lines, total, code = stamped_lines(command, root, {**os.environ, "PYTHONUNBUFFERED": "1"})
    if code != 0:
        raise RuntimeError(f"{command} exited with {code}:\n" + "\n".join(l for _, l in lines[-20:]))
    step_1, last = first(lines, COMPARE_FIRST_STEP), first(lines, re.compile(rf"Steps:.*\b{steps}/{steps} \["))
    return {"start_to_step_1": round(step_1, 2), "steps": round(last - step_1, 2), "total": round(total, 2)}


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows if k in r), 2) for k in rows[0]}


def ratios(this: list[dict[str, float]], baseline: list[dict[str, float]]) -> dict[str, float]:
    """Per phase, the median over rounds of this version's seconds over the baseline's in the same
    round: a slow moment of a shared machine moves both sides of one round's ratio."""
    pairs = list(zip(this, baseline))
    shared = [k for k in this[0] if all(a.get(k) and b.get(k) for a, b in pairs)]  # seen in every round
    return {k: round(statistics.median(a[k] / b[k] for a, b in pairs), 3) for k in shared}


def measure(root: Path, rounds: int = 3, baseline: Path | None = None, compare: str | None = None,
            steps: int = STEPS, kept: bool = False, cases: tuple[str, ...] = CASES[:3]) -> dict:
    """Per code version and scenario, the median of each phase over `rounds` interleaved rounds."""
    jobs = {"this": Job(root / "startup-this", REPO, steps)}
    if baseline:
        jobs["baseline"] = Job(root / "startup-baseline", baseline.resolve(), steps)
    for job in jobs.values() if "fresh_home" in cases else ():
        job.fresh_home()  # untimed: writes the database template (where the version keeps one)
    rows: dict[str, list[dict]] = {}
    with kept_server(jobs["this"]) if kept else nullcontext() as api_url:
        for _ in range(rounds):
            for name, job in jobs.items():
                for case in cases:
                    rows.setdefault(f"{name}_{case}", []).append(job.case(case))
            for name, job in jobs.items() if kept else ():
                rows.setdefault(f"{name}_kept_server_train", []).append(job.run("--force", "train", api_url=api_url))
                rows.setdefault(f"{name}_kept_server_noop", []).append(job.run(ends=NOOP_PHASES, api_url=api_url))
            if compare:
                rows.setdefault("compare", []).append(compare_run(compare, root, jobs["this"].root / "model", steps))
    by_round = {name: [row["encode_stage"] for row in r] for name, r in rows.items() if "encode_stage" in r[0]}
    compared = {f"this_over_baseline_{case}": ratios(rows[f"this_{case}"], rows[f"baseline_{case}"])
                for case in cases if baseline}
    return {"job": f"demo, {steps} steps, stops after train (fresh_all: every stage)", "rounds": rounds,
            **{name: medians(r) for name, r in rows.items()}, **compared, "encode_stage_by_round": by_round}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("bench-run"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps (start-up does not depend on them)")
    parser.add_argument("--baseline", type=Path, help="another checkout, run in the same rounds")
    parser.add_argument("--compare", help="a command run in the same rounds ({model} {images} {out})")
    parser.add_argument("--kept-server", action="store_true", help="also train and noop with a Prefect server"
                        " kept running between commands")
    parser.add_argument("--case", action="append", choices=CASES, help="the scenarios to time (default:"
                        " fresh, train, noop)")
    parser.add_argument("--note", default="", help="written after the result's name in BENCHMARKS.md")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m benchmarks.startup_bench", *sys.argv[1:]])
    result = measure(args.root.resolve(), args.rounds, args.baseline, args.compare, args.steps, args.kept_server,
                     tuple(args.case or CASES[:3]))
    print(json.dumps(result, indent=1))
    ResultsSection(command).add("startup" + (f" ({args.note})" if args.note else ""), result)


if __name__ == "__main__":
    main()
