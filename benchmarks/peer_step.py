"""lorapipe's training step against diffusers' own LoRA training script (issue 41 §3), at real size
on the same random weights, in rounds alternating the two, each a process tree measured as
benchmarks/real_size measures a stage.

    python -m benchmarks.peer_step --peer-script /tmp/peer/train_text_to_image_lora.py [--arch sd15]
        [--resolution 512] [--steps 2] [--rounds 2] [--root /tmp/rsreal]

The script is not ours: get examples/text_to_image/train_text_to_image_lora.py of the installed
diffusers' release and pass its path, and run the bench with a Python that also has the script's
`datasets` and `torchvision`, which the project does not install (BENCHMARKS.md says how it was run
here). It runs as a user runs it, through `accelerate launch`, on the same model folder and generated
images (copied beside a metadata.jsonl of their captions, the folder its --train_data_dir reads), at
batch 1, rank 4, the same steps, float32. lorapipe's step is on cached latents and text embeddings
while the script encodes every step: that is the comparison.
Step seconds: lorapipe's from the train artifact's logs/loss.jsonl, the script's from the elapsed
time its tqdm progress bar prints at each step (whole seconds).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from .common import ResultsSection, machine
from .real_size import Bench, measured, model_row, outcome, step_seconds, write_config

PEER_RANK = 4  # lorapipe's default LoRA rank
TQDM_ELAPSED = re.compile(r"Steps:[^|\r\n]*\|[^|\r\n]*\|\s*(\d+)/\d+ \[(?:(\d+):)?(\d+):(\d+)<")


def peer_data(images: Path, out: Path) -> Path:
    """`images` (PNGs with .txt captions) as the script's --train_data_dir: the PNGs and a
    metadata.jsonl of their captions, the layout of a datasets imagefolder."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rows = []
    for image in sorted(images.glob("*.png")):
        shutil.copy(image, out / image.name)
        rows.append({"file_name": image.name, "text": image.with_suffix(".txt").read_text()})
    (out / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def peer_command(script: Path, model: Path, data: Path, out: Path, bench: Bench) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
            "--num_cpu_threads_per_process", "1", "--mixed_precision", "no", str(script),
            "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_column", "text",
            "--resolution", str(bench.resolution), "--train_batch_size", "1", "--rank", str(PEER_RANK),
            "--max_train_steps", str(bench.steps), "--checkpointing_steps", str(bench.steps + 1),
            "--mixed_precision", "no", "--seed", "0", "--output_dir", str(out)]


def tqdm_step_seconds(stderr: str) -> list[float]:
    """Each step's seconds from a tqdm bar named "Steps": the elapsed time it printed at step n less
    the one at step n-1 (the last print of each step: the bar reprints on every postfix)."""
    elapsed = {}
    for match in TQDM_ELAPSED.finditer(stderr):
        step, hours, minutes, seconds = match.groups()
        elapsed[int(step)] = int(hours or 0) * 3600 + int(minutes) * 60 + int(seconds)
    return [float(elapsed[n] - elapsed[n - 1]) for n in sorted(elapsed) if n - 1 in elapsed]


def one_round(bench: Bench, config: Path, peer: list[str], logs: Path) -> dict:
    train = measured([sys.executable, "-m", "lorapipe", "run", str(config), "--only", "train", "--force", "train",
                      "--json"], logs / "lorapipe-train", bench.max_resident_mib)
    script = measured(peer, logs / "peer", bench.max_resident_mib)
    ours = step_seconds({"train": Path(next(row["path"] for row in json.loads(train.stdout)["stages"]
                                            if row["stage"] == "train"))}) if train.returncode == 0 else {}
    theirs = tqdm_step_seconds(script.stderr)
    row = {"lorapipe": {**outcome(train), **ours}, "peer": {**outcome(script), "step_seconds": theirs}}
    if ours and theirs:
        row["step_ratio"] = round(ours["last_step_s"] / theirs[-1], 3)
    row["peak_ratio"] = round(train.peak_mib / script.peak_mib, 3) if script.peak_mib else None
    return row


def measure(bench: Bench, root: Path, script: Path, rounds: int) -> dict:
    build, model = model_row(bench, root)
    config = write_config(bench, root, model)
    prepared = [{"stage": stage, **outcome(measured(
        [sys.executable, "-m", "lorapipe", "run", str(config), "--only", stage], config.parent / stage,
        bench.max_resident_mib))} for stage in ("preprocess", "encode")]
    data = peer_data(root / f"images-2-{bench.resolution}px", root / "peer-data")
    peer = peer_command(script, model, data, root / "peer-out", bench)
    return {"arch": bench.arch, "resolution": bench.resolution, "dtype": bench.dtype, "steps": bench.steps,
            "peer_script": str(script), "peer_command": " ".join(peer), "stages": [build, *prepared],
            "rounds": [one_round(bench, config, peer, config.parent) for _ in range(rounds)], "machine": machine()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-script", type=Path, required=True, help="diffusers' train_text_to_image_lora.py")
    parser.add_argument("--arch", default="sd15", help="a folder of stages/assets/arch/")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2, help="training steps of each run (the first one warms up)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-resident-gib", type=float, help="stop a run whose process tree passes this")
    parser.add_argument("--root", type=Path, default=Path("bench-run") / "real-size")
    args = parser.parse_args(argv)
    if not args.peer_script.is_file():
        parser.error(f"--peer-script {args.peer_script}: no such file")
    bench = Bench(args.arch, args.resolution, 0, args.steps, "none", "float32", False,
                  args.max_resident_gib and args.max_resident_gib * 1024)
    args.root.mkdir(parents=True, exist_ok=True)
    document = measure(bench, args.root.resolve(), args.peer_script.resolve(), args.rounds)
    print(json.dumps(document, indent=1), flush=True)
    ResultsSection(" ".join(["python -m benchmarks.peer_step", *(argv if argv is not None else sys.argv[1:])])).add(
        f"peer step {args.arch}", document)


if __name__ == "__main__":
    main()
