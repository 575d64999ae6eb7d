"""Library notes that tell a lorapipe user nothing, kept off the terminal and the logs; every other
warning is shown as the library logs it. Every process that runs stages drops them: the command's
(flows/cli.py), a deployment's flow process (flows/pipeline.py), and each worker process at its
start (stages/processes/launching.py begin_worker).

- transformers: "`CLIPImageProcessor` requires torchvision (not installed); falling back to ..."
  (also Siglip): loading a pipeline resolves image-processor classes we never use.
- diffusers: "No LoRA keys associated to <a text encoder's class> found with the prefix='text_encoder'"
  (or 'text_encoder_2'): our LoRAs train the denoiser only, so loading one into a pipeline finds none
  for its text encoders. The same note about the denoiser's prefix is shown: it means a LoRA loaded nothing.
- transformers: "`PaddleOCRVLProcessor` defines `image_processor_class = 'AutoImageProcessor'`, which is
  deprecated": transformers' own processor class (the tiny captioner's, Qwen-Image's) tells its
  maintainers, on every load of a captioner.
- torch: "flex_attention called without torch.compile() - this will use an unfused implementation ..."
  (a Python warning of ten lines): LTX-2.5's diffusion decoder attends through flex_attention; on a
  CPU it runs unfused, which its advice (compile it) does not change for a single decode.
- the libraries' own progress bars (loading weights, pipeline components): redrawn in place, they
  become a line per redraw in a log file and the Prefect log. Our stages print progress lines.
"""
from __future__ import annotations

import logging
import os
import re
import warnings

NO_TEXT_ENCODER_LORA = re.compile(r"No LoRA keys associated to \w+ found with the prefix='text_encoder")
HARMLESS = {  # logger -> the messages it logs that are dropped
    "transformers.utils.import_utils": re.compile(r"`\w+ImageProcessor` requires torchvision \(not installed\)"),
    "transformers.processing_utils": re.compile(r"`PaddleOCRVLProcessor` defines `\w+_class = '\w+'`, which is deprecated"),
    "diffusers.loaders.peft": NO_TEXT_ENCODER_LORA,
    "diffusers.loaders.lora_base": NO_TEXT_ENCODER_LORA,
}


class _DropHarmless(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_harmless_notes() -> None:
    """Install the filters in this process (idempotent). Library progress bars stay off in this
    process and its children unless TQDM_DISABLE is set (where tqdm is not imported yet)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
    for name, pattern in HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):
            logger.addFilter(_DropHarmless(pattern))
