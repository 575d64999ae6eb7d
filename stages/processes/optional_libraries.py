"""Optional libraries a process hides when nothing it runs uses them: bitsandbytes and torchao.

diffusers imports both whenever they are installed (diffusers.quantizers, on `import diffusers`),
and bitsandbytes compiles its kernels with torch.compile when imported, which loads torch._inductor:
together about a quarter of a process's imports on two cores (BENCHMARKS.md, start-up). Only
training uses them (train.base_quantization, train.optimizer: adamw8bit), in its own process, so:

- `lorapipe run` and `lorapipe demo` hide both in their own process (flows/cli.py), where the flow
  runs preprocess, and encode and evaluate when the command started no warm process, and so does a
  deployment's flow run (flows/pipeline.py);
- a process started for a job (stages/processes/jobs.py) hides those the job names before it imports the
  stage's code: both for encode, those a training does not use for train (stages/train/launch.py);
  the warm process hides those of the training it was started for (encode's and evaluate's jobs
  use neither);
- so do the workers of the Dask cluster encode starts for itself (stages/processes/placement.py).

Hiding is `sys.modules[name] = None` before anything imports diffusers: `import name` then raises
ImportError and importlib.util.find_spec returns None, which is how diffusers, peft, transformers
and accelerate look for them, so the process runs as it would where they are not installed. Our own
checks of a setting's library ask `installed`, which looks at the installation itself.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from typing import Iterable

OPTIONAL = ("bitsandbytes", "torchao")


def hide(names: Iterable[str] = OPTIONAL) -> None:
    """Hide `names` from this process; call it before diffusers is imported (one already imported stays)."""
    for name in names:
        sys.modules.setdefault(name, None)


def installed(name: str) -> bool:
    """Whether the module `name` is installed, also where this process hides it (find_spec says
    None for a hidden name; the path finder looks at the installation)."""
    return importlib.util.find_spec(name) is not None or importlib.machinery.PathFinder.find_spec(name) is not None


def dask_setup(worker: object) -> None:
    """Dask's preload hook (LocalCluster(preload=[this module])): a worker the encode stage starts
    for itself runs only encode's tasks, which never use either library."""
    hide()
