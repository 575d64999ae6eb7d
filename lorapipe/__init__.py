"""lorapipe: content-cached LoRA fine-tuning of diffusion models, orchestrated by Prefect.

Installed, the repository's folders are this package's subpackages: `lorapipe.flows` (the Prefect
layer and the CLI), `lorapipe.stages` (the ML code), `lorapipe.cache` (the artifact and sample
store), `lorapipe.configs` (the presets). In a source checkout they stay at the repository's root,
beside this folder, and are found from here, so a checkout imports as an installed copy does.
"""
from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
if not (_here / "stages").is_dir():  # a source checkout: flows/, stages/, cache/ sit beside this folder
    __path__.append(str(_here.parent))
