"""Real size on the CPU: a family's published architecture (stages/assets/arch/<arch>/, seeded random
weights stored in --dtype) through the real stages, `lorapipe run --only STAGE` one stage per command on 2
generated samples, from a config this bench writes beside them.

Reports, per stage (the model's build first), the peak resident memory of the command's whole
process tree (Prefect's server, the warm process and the training process included), the peak of its
anonymous part (what is not file pages: weights loaded as stored stay mapped from their files), and
its wall seconds; per component its parameters, its stored dtype and the dtype encode and train ran it in
(read from their artifacts); and the seconds of each training step (the train artifact's
logs/loss.jsonl). A stage that fails, or whose tree passes --max-resident-gib (then stopped), says
so and the stages after it are not run.

    python -m benchmarks.real_size --arch sd15 [--resolution 512] [--frames N] [--steps 2]
        [--base-quantization none|int8|fp8|nf4] [--dtype bfloat16|float32] [--text-encoder-dtype bfloat16|float32]
        [--vae-dtype bfloat16|float32] [--gradient-checkpointing] [--keep-cache]
        [--max-resident-gib 10] [--root DIR] [--json]

appends its document to BENCHMARKS.md; `--tiny` runs the same code on the family's tiny model (the
smoke test, tests/test_real_size.py) and only prints. `--text-encoder-dtype` stores the text stage's
models in another dtype than --dtype, as published models store theirs in bf16: encode runs a text
encoder in the dtype it is stored in (transformers loads it as stored) and the VAE in float32
(diffusers' default), so a float32 row keeps its big text encoder in bf16. `--vae-dtype` stores the
VAE in another dtype, which evaluate decodes in (it loads a VAE as stored): float32 beside a bf16
row, whose VAE would otherwise convolve in bf16, which this CPU does through a reference loop.
The model is built once under ROOT/models/<arch>-<dtype>[-text-<dtype>][-vae-<dtype>]
(benchmarks/common.py's random_model: one component at a time, created in its dtype where it is
initialised, saved and freed, so the build never holds the model twice) and reused; the run's
cache is emptied before every run, unless --keep-cache, which serves the stages whose key did not change
from it (their rows say so).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .common import ResultsSection, generated_clips, generated_images, machine

REPO = Path(__file__).resolve().parent.parent
SAMPLES = 2
SAMPLE_EVERY_S = 0.2  # how often the process tree's resident memory is read
MIXED_PRECISION = {"bfloat16": "bf16", "float32": "no"}  # train.mixed_precision running the denoiser in a dtype
BUILD = """
import sys
from pathlib import Path
import torch
from benchmarks.common import arch_folder, random_model, tiny_arch
from lorapipe.stages.families import build_tiny_model
arch, out, dtype, text_dtype, vae_dtype = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
if dtype == "tiny":
    build_tiny_model(out, tiny_arch(arch))
else:
    random_model(arch_folder(arch), out, torch.device("cpu"), dtype, text_dtype, vae_dtype)
"""


@dataclass(frozen=True)
class Bench:
    arch: str  # a folder of stages/assets/arch/
    resolution: int
    frames: int  # clips of this many frames; 0: images
    steps: int
    base_quantization: str
    dtype: str  # encode's record dtype and train's denoiser dtype: "bfloat16" or "float32"
    tiny: bool  # the family's tiny model instead of the published architecture
    max_resident_mib: float | None
    text_encoder_dtype: str | None = None  # what the text stage's models are stored (and encode runs them) in
    vae_dtype: str | None = None  # what the VAE is stored (and evaluate decodes) in
    gradient_checkpointing: bool = False  # train.gradient_checkpointing, as the big families' presets set it
    keep_cache: bool = False  # serve unchanged stages from the last run's cache instead of emptying it

    @property
    def stored_text_dtype(self) -> str:
        return self.text_encoder_dtype or self.dtype

    @property
    def stored_vae_dtype(self) -> str:
        return self.vae_dtype or self.dtype


# ---- measuring a command
@dataclass(frozen=True)
class Measured:
    returncode: int | None  # None: stopped for passing the memory limit
    peak_mib: float
    peak_anonymous_mib: float  # of the sampled tree: its memory that is not file pages
    seconds: float
    stdout: str
    stderr: str


def tree_memory_kib(pid: int) -> tuple[int, int]:
    """Resident and anonymous resident memory (VmRSS, RssAnon) of a process and all its descendants
    ((0, 0) for one that has gone). Their difference is mostly file pages: weights loaded in the dtype
    they are stored in stay mapped from their safetensors file, which the kernel can drop and re-read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        children = " ".join(p.read_text() for p in Path(f"/proc/{pid}/task").glob("*/children"))
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1])
              for line in status.splitlines() if line.startswith(("VmRSS:", "RssAnon:"))}
    descendants = [tree_memory_kib(int(child)) for child in children.split()]
    return (fields.get("VmRSS", 0) + sum(rss for rss, _ in descendants),
            fields.get("RssAnon", 0) + sum(anon for _, anon in descendants))


def measured(command: list[str], logs: Path, limit_mib: float | None) -> Measured:
    """Run `command` in a session of its own, its output into logs.out and logs.err. Its peak resident
    memory: the larger of the sampled sum over its process tree and the kernel's high-water mark of
    its largest process (wait4's, which a peak shorter than a sample cannot pass unseen)."""
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    started, peak_kib, peak_anon_kib, done, stopped = time.perf_counter(), 0, 0, threading.Event(), threading.Event()
    with open(out, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, stdout=stdout, stderr=stderr, start_new_session=True,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def sample() -> None:
        nonlocal peak_kib, peak_anon_kib
        while not done.wait(SAMPLE_EVERY_S):
            rss_kib, anon_kib = tree_memory_kib(process.pid)
            peak_kib, peak_anon_kib = max(peak_kib, rss_kib), max(peak_anon_kib, anon_kib)
            if limit_mib and peak_kib / 1024 > limit_mib and not stopped.is_set():
                stopped.set()
                os.killpg(process.pid, signal.SIGKILL)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(process.pid, 0)
    done.set()
    sampler.join()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return Measured(None if stopped.is_set() else process.returncode, round(max(peak_kib, usage.ru_maxrss) / 1024, 1),
                    round(peak_anon_kib / 1024, 1), round(time.perf_counter() - started, 1), out.read_text(),
                    err.read_text())


# ---- the run
def model_row(bench: Bench, root: Path) -> tuple[dict, Path]:
    """The model's build (in a process of its own, measured as a stage is), or that it was reused."""
    text = f"-text-{bench.stored_text_dtype}" if bench.stored_text_dtype != bench.dtype else ""
    vae = f"-vae-{bench.stored_vae_dtype}" if bench.stored_vae_dtype != bench.dtype else ""
    model = root / "models" / (f"{bench.arch}-tiny" if bench.tiny else f"{bench.arch}-{bench.dtype}{text}{vae}")
    weights = "the family's tiny model" if bench.tiny else (
        f"random, published architecture, {bench.dtype}, text stage {bench.stored_text_dtype}, VAE {bench.stored_vae_dtype}")
    if (model / "model_index.json").exists():
        return {"stage": "build", "weights": weights, "status": "reused", "path": str(model)}, model
    shutil.rmtree(model, ignore_errors=True)
    model.parent.mkdir(parents=True, exist_ok=True)
    run = measured([sys.executable, "-c", BUILD, bench.arch, str(model), "tiny" if bench.tiny else bench.dtype,
                    bench.stored_text_dtype, bench.stored_vae_dtype],
                   root / "build", bench.max_resident_mib)
    return {"stage": "build", "weights": weights, **outcome(run), "path": str(model)}, model


def outcome(run: Measured) -> dict:
    if run.returncode is None:
        status = "stopped: its resident memory passed --max-resident-gib"
    elif run.returncode:
        status = "failed: " + next(iter(run.stderr.strip().splitlines()[-1:]), f"exit code {run.returncode}")
    else:
        status = "completed"
    return {"status": status, "peak_resident_mib": run.peak_mib, "peak_anonymous_mib": run.peak_anonymous_mib,
            "seconds": run.seconds}


def write_config(bench: Bench, root: Path, model: Path) -> Path:
    """A config running `model` on SAMPLES generated images (or clips) at the bench's size, in a folder
    of its own, emptied first."""
    import yaml

    side, frames = bench.resolution, bench.frames
    if frames:
        data = generated_clips(root / f"clips-{SAMPLES}-{frames}x{side}", SAMPLES, frames, (side, side))
    else:
        data = generated_images(root / f"images-{SAMPLES}-{side}px", SAMPLES, side)
    work = root / "run"
    for old in work.glob("*") if work.exists() else ():
        if not (bench.keep_cache and old.name == "cache"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    work.mkdir(exist_ok=True)
    quantization = {"base_quantization": bench.base_quantization} if bench.base_quantization != "none" else {}
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump({
        "name": f"real-size-{bench.arch}", "cache_dir": "cache", "output_dir": "out",
        "model": {"path": str(model)}, "data": {"path": str(data)},
        "preprocess": {"resolution": side, "holdout_fraction": 0.0, **({"video": {"num_frames": frames}} if frames else {})},
        "encode": {"batch_size": 1, "dtype": bench.dtype},
        "train": {"max_steps": bench.steps, "batch_size": 1, "mixed_precision": MIXED_PRECISION[bench.dtype],
                  "checkpoint_every": bench.steps, "gradient_checkpointing": bench.gradient_checkpointing,
                  "log_with": "none", **quantization},
        "evaluate": {"prompts": ["a generated image"], "seeds": [0], "num_inference_steps": 1, "resolution": side,
                     "loss_timesteps": [500], **({"num_frames": frames} if frames else {})},
    }))
    return config


def stage_rows(bench: Bench, config: Path) -> tuple[list[dict], dict[str, Path]]:
    """Each stage through `lorapipe run --only STAGE` (the ones before it served from the cache), and
    the artifact each computed; after one that did not complete, the rest are not run."""
    from lorapipe.flows.steps import STAGES

    rows, artifacts, incomplete = [], {}, None
    for stage in STAGES:
        if incomplete:
            rows.append({"stage": stage, "status": f"not run: {incomplete} did not complete"})
            continue
        run = measured([sys.executable, "-m", "lorapipe", "run", str(config), "--only", stage, "--json"],
                       config.parent / stage, bench.max_resident_mib)
        row = {"stage": stage, **outcome(run)}
        if run.returncode == 0:
            ran = next(r for r in json.loads(run.stdout)["stages"] if r["stage"] == stage)
            artifacts[stage] = Path(ran["path"])
            if ran["status"] != "computed":
                row["status"] = "served from the last run's cache (--keep-cache): its figures are a cache hit's"
        else:
            incomplete = stage
        rows.append(row)
    return rows, artifacts


def component_rows(config: Path, artifacts: dict[str, Path]) -> dict[str, dict]:
    """Per component (`lorapipe model`'s): its parameters, stored dtype, and the dtype each stage that
    completed ran it in, as its artifact records it."""
    from lorapipe.stages.families import for_model

    described = json.loads(subprocess.run([sys.executable, "-m", "lorapipe", "model", str(config), "--json"],
                                          cwd=REPO, check=True, capture_output=True, text=True).stdout)
    ran_in = {}
    if "encode" in artifacts:
        ran_in["encode"] = json.loads((artifacts["encode"] / "samples.json").read_text())["dtype"]
    if "train" in artifacts:
        params = json.loads((artifacts["train"] / "train_config.json").read_text())["params"]
        ran_in["train"] = {v: k for k, v in MIXED_PRECISION.items()}[params["mixed_precision"]] + (
            f", Linear weights {params['base_quantization']}" if params.get("base_quantization", "none") != "none" else "")
    components = for_model(Path(described["source"]["location"])).components
    return {
        row["name"]: {"class": row["class_name"], "parameters": row["parameters"], "stored_dtype": row["dtype"],
                      **{f"{stage}_dtype": dtype for stage, dtype in ran_in.items()
                         if row["name"] in components.for_stage(stage) and row["parameters"]}}
        for row in described["components"] if row["parameters"]
    }


def step_seconds(artifacts: dict[str, Path]) -> dict:
    """The training steps' seconds, as the train stage logged them (the first one warms up)."""
    if "train" not in artifacts:
        return {}
    rows = [json.loads(line) for line in (artifacts["train"] / "logs" / "loss.jsonl").read_text().splitlines()]
    seconds = [row["seconds"] for row in rows]
    return {"steps": len(rows), "step_seconds": seconds, "last_step_s": seconds[-1]}


def measure(bench: Bench, root: Path) -> dict:
    build, model = model_row(bench, root)
    head = {"arch": bench.arch, "resolution": bench.resolution, "frames": bench.frames, "dtype": bench.dtype,
            "text_encoder_dtype": bench.stored_text_dtype, "vae_dtype": bench.stored_vae_dtype,
            "base_quantization": bench.base_quantization,
            "gradient_checkpointing": bench.gradient_checkpointing, "samples": SAMPLES}
    if build["status"] not in ("completed", "reused"):
        return {**head, "stages": [build], "machine": machine()}
    config = write_config(bench, root, model)
    stages, artifacts = stage_rows(bench, config)
    return {**head, "stages": [build, *stages], "components": component_rows(config, artifacts),
            "train_steps": step_seconds(artifacts), "machine": machine()}  # torch imported after the stages ran


def summary(document: dict) -> str:
    lines = [f"{document['arch']} at {document['resolution']} px" + (f", {document['frames']} frames" * bool(document["frames"]))
             + f", {document['dtype']} (text stage {document['text_encoder_dtype']}, VAE {document['vae_dtype']}), base"
             f" {document['base_quantization']}, {document['machine']}"]
    for row in document["stages"]:
        figures = (f"{row['peak_resident_mib']:>9.1f} MiB peak ({row['peak_anonymous_mib']:.1f} anonymous)"
                   f" {row['seconds']:>8.1f} s  ") if "seconds" in row else ""
        lines.append(f"  {row['stage']:<10} {figures}{row['status']}")
    for name, row in document.get("components", {}).items():
        ran = ", ".join(f"{k.removesuffix('_dtype')} {v}" for k, v in row.items() if k.endswith("_dtype") and k != "stored_dtype")
        lines.append(f"  {name:<16} {row['parameters']:>14,} parameters, stored {row['stored_dtype']}" + (f", ran in {ran}" if ran else ""))
    if document.get("train_steps"):
        lines.append(f"  train steps (s): {document['train_steps']['step_seconds']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_size", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", required=True, help="a folder of stages/assets/arch/")
    parser.add_argument("--resolution", type=int, default=512, help="the samples' side in pixels")
    parser.add_argument("--frames", type=int, default=0, help="clips of this many frames (video families); 0: images")
    parser.add_argument("--steps", type=int, default=2, help="training steps (the first one warms up)")
    parser.add_argument("--base-quantization", choices=("none", "int8", "fp8", "nf4"), default="none")
    parser.add_argument("--dtype", choices=tuple(MIXED_PRECISION), default="bfloat16",
                        help="what encode and train run the model in; float32 on a CPU without bf16 kernels, where"
                        " torch convolves bf16 through a reference loop (a UNet's step takes hours)")
    parser.add_argument("--text-encoder-dtype", choices=tuple(MIXED_PRECISION),
                        help="store the text stage's models in this dtype (default: --dtype); encode and evaluate"
                        " run a text encoder as stored, so bfloat16 halves a float32 row's text encoder")
    parser.add_argument("--vae-dtype", choices=tuple(MIXED_PRECISION),
                        help="store the VAE in this dtype (default: --dtype); evaluate decodes in it, so float32"
                        " keeps a bfloat16 row's decode off this CPU's bf16 reference convolution")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="train.gradient_checkpointing (the presets of the families over 2B parameters set it)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="keep the last run's cache under ROOT: stages whose key did not change are served from"
                        " it (a rerun of a row's later stages without its hour of encoding)")
    parser.add_argument("--max-resident-gib", type=float, help="stop a stage whose process tree passes this")
    parser.add_argument("--root", type=Path, default=Path("bench-run") / "real-size")
    parser.add_argument("--tiny", action="store_true", help="the family's tiny model; prints only")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    limit = args.max_resident_gib and args.max_resident_gib * 1024
    bench = Bench(args.arch, args.resolution, args.frames, args.steps, args.base_quantization, args.dtype, args.tiny,
                  limit, args.text_encoder_dtype, args.vae_dtype, args.gradient_checkpointing, args.keep_cache)
    args.root.mkdir(parents=True, exist_ok=True)
    document = measure(bench, args.root.resolve())
    print(json.dumps(document) if args.json else summary(document), flush=True)
    if not args.tiny:
        ResultsSection(" ".join(["python -m benchmarks.real_size", *(argv if argv is not None else sys.argv[1:])])).add(
            f"real size {args.arch}", document)


if __name__ == "__main__":
    main()
