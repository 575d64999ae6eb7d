"""train.compile: torch.compile of each block of the denoiser (families.swappable_blocks).

Each block is compiled in place (`nn.Module.compile`), so module names, the adapter's state dict,
DDP and gradient checkpointing (which calls the compiled block inside its checkpoint) see the same
modules as without it. The first step of each new input shape pays for the compilation (inductor
writes C++ on the CPU, Triton on CUDA: a C++ compiler is needed on the CPU). Inductor fuses and
reorders float operations, so losses differ from eager ones by float rounding only, like a change
of thread count; its own random numbers are switched off (`fallback_random`), so LoRA dropout draws
what eager draws.
"""
from __future__ import annotations

import torch


def compile_blocks(blocks: list[torch.nn.Module]) -> None:
    """Compile every block in place; their random draws stay eager's."""
    import torch._inductor.config

    torch._inductor.config.fallback_random = True
    for block in blocks:
        block.compile()

