"""Peak resident memory of training the tiny model with each `train.base_quantization` and with
gradient checkpointing on and off, each in a fresh process (ratios to the unquantised run, taken
in the same run of this benchmark).

Each setting's process imports the stack (diffusers imports torchao and bitsandbytes when they are
installed, whatever the setting), then sets up the train stage's recipe over the same
encoded shards (64 px images, batch 4, LoRA rank 4 on attention, float32 as the stage runs on a
CPU) and runs `steps` training steps on one torch thread. The model: the tests' tiny SD1.5, or
with `--full-size` SD1.5 at its published size (random weights from stages/assets/arch/sd15, built
once under ROOT/models/sd15 by gpu_bench's builder: a 3.4 GB float32 UNet, so the weights show;
2 steps of each quantisation, without checkpointing). Figures: `imports_mib` (VmRSS before the
recipe), `load_peak_mib` (VmHWM after the set-up: every setting loads the full-precision weights
first), `setup_mib` (VmRSS after the denoiser is loaded, quantised and wrapped, and glibc has been
asked to return freed memory: malloc_trim), `train_peak_mib` (VmHWM over the steps alone: the peak
is reset after the set-up), the training peak above the imports, and the step's milliseconds (the
mean after the first).
The tiny denoiser holds 3 MB of weights, so its process's memory is mostly the libraries.

    python -m benchmarks.quant_memory_bench [--root DIR] [--full-size]
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .common import full_size_cli, full_size_sd15, generated_images, tiny_model

REPO = Path(__file__).resolve().parent.parent
IMAGES = 16
SETTINGS = (("none", False), ("int8", False), ("fp8", False), ("nf4", False), ("none", True), ("int8", True))
FULL_SIZE_SETTINGS = SETTINGS[:4]  # checkpointing saves activations, which are small at 64 px; minutes each on a CPU
CHILD = """
import json, sys
from pathlib import Path
from benchmarks.quant_memory_bench import child
print(json.dumps(child(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]))))
"""


def _reset_peak() -> None:
    """Return freed heap pages to the kernel and restart VmHWM from the current VmRSS."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps the freed full-precision weights otherwise
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak resident set size


def _status_mib(field: str) -> float:
    kib = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)
    return round(int(kib) / 1024, 1)


def child(cache: Path, model: Path, quantization: str, checkpointing: bool, steps: int) -> dict:
    """One setting, in this (fresh) process: its memory figures and step time."""
    import time
    from types import SimpleNamespace

    import diffusers  # noqa: F401  (the stack, and torchao and bitsandbytes where installed: diffusers imports them)
    import peft  # noqa: F401
    import torch

    from lorapipe.stages.train import recipe  # noqa: F401
    from .train_bench import cached_step, training_recipe

    torch.set_num_threads(1)
    imports = _status_mib("VmRSS")
    inputs = SimpleNamespace(cache_root=cache, model_path=model)  # what encode_inputs returned to the parent
    work = cache / f"work-{quantization}-{int(checkpointing)}"
    recipe = training_recipe(inputs, cache / "encoded", work, loader_workers=0, gradient_checkpointing=checkpointing,
                             base_quantization=quantization)
    load_peak = _status_mib("VmHWM")
    _reset_peak()
    setup, step = _status_mib("VmRSS"), cached_step(recipe)
    step(0)  # the first step allocates the optimizer states
    started = time.perf_counter()
    for i in range(1, steps):
        step(i)
    step_ms = (time.perf_counter() - started) / (steps - 1) * 1e3
    recipe.batches.close()
    peak = _status_mib("VmHWM")
    return {"imports_mib": imports, "load_peak_mib": load_peak, "setup_mib": setup, "train_peak_mib": peak,
            "train_peak_over_imports_mib": round(peak - imports, 1), "step_ms": round(step_ms, 1)}


def measure(root: Path, full_size: bool = False) -> dict:
    """Every setting's figures, each from its own process, with ratios to the unquantised run's."""
    from .encode_bench import encode_inputs, run_encode

    if full_size:
        model, steps, settings = full_size_sd15(root), 2, FULL_SIZE_SETTINGS
    else:
        model, steps, settings = tiny_model(root), 8, SETTINGS
    cache = root / "quant-memory"
    shutil.rmtree(cache, ignore_errors=True)
    inputs = encode_inputs(generated_images(root / f"images-{IMAGES}", IMAGES), cache, model)
    run_encode(inputs, cache / "encoded", workers=0)
    rows = {}
    for quantization, checkpointing in settings:
        out = subprocess.run([sys.executable, "-c", CHILD, str(inputs.cache_root), str(inputs.model_path), quantization,
                              str(int(checkpointing)), str(steps)],
                             cwd=REPO, check=True, capture_output=True, text=True).stdout
        rows[f"{quantization}, checkpointing {'on' if checkpointing else 'off'}"] = json.loads(out.splitlines()[-1])
    base = rows["none, checkpointing off"]
    for row in rows.values():
        row["train_peak_ratio"] = round(row["train_peak_mib"] / base["train_peak_mib"], 3)
        row["train_peak_over_imports_ratio"] = round(row["train_peak_over_imports_mib"]
                                                     / base["train_peak_over_imports_mib"], 3)
    name = "SD1.5 at full size, random weights" if full_size else "tiny sd15"
    return {"model": name, "resolution": 64, "batch": 4, "steps": steps, "torch_threads": 1, **rows}


def main() -> None:
    full_size_cli("benchmarks.quant_memory_bench", __doc__.split("\n\n")[0], "quant_memory", measure)


if __name__ == "__main__":
    main()
