"""A quantised frozen base (`train.base_quantization`): the denoiser's Linear weights stored in 8 or
4 bits while the adapter trains in full precision beside them (QLoRA's recipe), for any family.

- int8: torchao's Int8WeightOnlyConfig (per-channel symmetric int8, dequantised in the matmul);
- fp8: torchao's Float8WeightOnlyConfig (float8 e4m3 weights, per-channel scales);
- nf4: bitsandbytes' Linear4bit with NF4 and double quantisation (QLoRA's format).

All three run on CPU and CUDA with torchao >= 0.18 and bitsandbytes >= 0.50 (its CPU backend); peft
wraps the torchao layers with its TorchaoLoraLinear and a Linear4bit (a torch.nn.Linear) with its
plain lora.Linear, whose forward calls the quantised layer and adds the adapter. The adapter's
tensors, and so the exported LoRA files, have the same names and shapes as without quantisation.

Every Linear layer of the denoiser is quantised, one at a time, on its way to the device, so the
device never holds the full-precision model (the host does, once, at the training dtype). Under
DDP, the base's tensors are left out of DDP's start-up broadcast (which cannot copy a quantised
tensor, and need not: every rank loads and quantises the same weights the same way).
Quantisation changes the result, so the setting is keyed (TrainParams.base_quantization).
Imports nothing heavy at module level: TrainParams checks availability with `check_available`.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal

from lorapipe.stages.processes.optional_libraries import installed

if TYPE_CHECKING:
    import torch

BaseQuantization = Literal["none", "int8", "fp8", "nf4"]
LIBRARY = {"int8": "torchao", "fp8": "torchao", "nf4": "bitsandbytes"}  # the module each setting imports


def check_available(setting: BaseQuantization) -> None:
    """Refuse, in one line naming the key, a setting whose library is not installed."""
    library = LIBRARY.get(setting)
    if library and not installed(library):
        raise ValueError(f"train.base_quantization: {setting} needs {library} (pip install 'lorapipe[quant]'),"
                         " or set base_quantization: none")


def quantize_base(denoiser: torch.nn.Module, setting: BaseQuantization, device: torch.device) -> None:
    """Quantise the frozen denoiser's Linear weights in place, each moved to `device` first (the
    rest of the model stays where it is: the caller moves it)."""
    if setting == "none":
        return
    if setting == "nf4":
        _replace_with_nf4(denoiser, device)
    else:
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        # peft warns that merge() needs torchao's re-quantisation recipe; training never merges
        warnings.filterwarnings("ignore", message=".*instantiated without `get_apply_tensor_subclass`")
        quantize_(denoiser, Int8WeightOnlyConfig() if setting == "int8" else Float8WeightOnlyConfig(), device=device)


def keep_base_out_of_ddp_sync(denoiser: torch.nn.Module, setting: BaseQuantization) -> None:
    """With a quantised base, DDP (when the model is prepared for it) synchronises the adapter only:
    every frozen parameter and buffer is left to each rank as it loaded it."""
    if setting == "none":
        return
    from torch.nn.parallel import DistributedDataParallel

    frozen = [name for name, tensor in denoiser.named_parameters() if not tensor.requires_grad]
    names = frozen + [name for name, _ in denoiser.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(denoiser, names)


def _replace_with_nf4(denoiser: torch.nn.Module, device: torch.device) -> None:
    """Every torch.nn.Linear child swapped for a bitsandbytes Linear4bit holding the same weights,
    which it quantises when moved to the device; it computes in the weights' own dtype."""
    import bitsandbytes as bnb
    import torch

    for parent in list(denoiser.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            quantised = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=child.weight.dtype, quant_type="nf4", device="meta")
            quantised.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True, module=quantised)
            if child.bias is not None:
                quantised.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, quantised.to(device))
