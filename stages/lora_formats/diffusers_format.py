"""LoRA weight files: diffusers format (what `load_lora_weights` reads; keys under the denoiser's
component name, `unet.` or `transformer.`), written and loaded back; the other formats are
original_names.py's and lycoris.py's, which each family writes in its own module names.

Every file carries provenance in their safetensors metadata. Files are byte-deterministic: the
safetensors library writes metadata keys in a per-process random order, so the header is
rewritten here with sorted keys.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

ADAPTER = "default"
PEFT_KEY_PARTS = ("lora_A.", "lora_B.", "lora_magnitude_vector", "lokr_", "hada_")  # what peft names adapter tensors


def _json(value: Any) -> str:
    # peft configs hold sets (target_modules): sort them so the file is reproducible
    return json.dumps(value, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set) else str(v))


def save_safetensors_sorted(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    """Write a safetensors file whose bytes depend only on its contents; atomic, mode 0644."""
    raw = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    header = {"__metadata__": dict(sorted(metadata.items())), **header}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data section to 8 bytes
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + header_len :])
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def lora_scale(config: Any) -> float:
    """What a LoRA's product B A is multiplied by: alpha / rank, or alpha / sqrt(rank) with rsLoRA.
    Files in the kohya and ComfyUI formats must carry it as their loaders read it (alpha / rank)."""
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def peft_state_dict(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(denoiser, adapter_name=ADAPTER)


def write_diffusers_lora(denoiser: torch.nn.Module, path: Path, provenance: dict[str, str], prefix: str) -> None:
    """The file `load_lora_weights` reads (lora_folder.LORA_FILE in a LoRA folder): PEFT keys under
    `<prefix>.` (the denoiser's component name) and the adapter config (without it, alpha != rank
    loads at the wrong strength). Not passed through `convert_state_dict_to_diffusers`: it renames linear layers only,
    and the loader skipped the renamed ones in a file that also held conv LoRA."""
    tensors = {f"{prefix}.{k}": v for k, v in peft_state_dict(denoiser).items()}
    config = json.loads(_json(denoiser.peft_config[ADAPTER].to_dict()))
    adapter_metadata = {f"{prefix}.{k}": v for k, v in config.items()}
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps(adapter_metadata, indent=2, sort_keys=True)}
    save_safetensors_sorted(tensors, {**metadata, **provenance}, path)


def load_diffusers_lora(denoiser: torch.nn.Module, path: Path, prefix: str) -> None:
    """Load a file written by `write_diffusers_lora` into a denoiser that already has the adapter."""
    from diffusers.utils import convert_unet_state_dict_to_peft
    from peft import set_peft_model_state_dict

    tensors = {k.removeprefix(f"{prefix}."): v for k, v in load_file(path).items()}
    if not all(any(part in k for part in PEFT_KEY_PARTS) for k in tensors):
        # an older diffusers spelling (`to_q_lora.down`); never convert PEFT keys: the conversion
        # renames `to_out.lora_magnitude_vector` to `to_out.0.`, which Flux.2's single blocks lack
        tensors = convert_unet_state_dict_to_peft(tensors)
    result = set_peft_model_state_dict(denoiser, tensors, adapter_name=ADAPTER)
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    missing = [k for k in getattr(result, "missing_keys", None) or [] if "lora_" in k]
    if unexpected or missing:
        raise ValueError(f"{path} does not match this model's LoRA layers: unexpected {unexpected[:3]},"
                         f" missing {missing[:3]}")


def recorded_adapter(path: Path, prefix: str) -> dict[str, Any]:
    """The peft config a file written by `write_diffusers_lora` records (keys without `<prefix>.`)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        recorded = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
    return {k.removeprefix(f"{prefix}."): v for k, v in recorded.items()}


def adapter_kind(config: dict[str, Any]) -> str:
    """lora, dora, lokr or loha, from a recorded peft config (a file without one holds a LoRA)."""
    kind = str(config.get("peft_type", "LORA")).removeprefix("PeftType.").lower()
    return "dora" if kind == "lora" and config.get("use_dora") else kind


def add_adapter_from_file(denoiser: torch.nn.Module, path: Path, prefix: str, adapter_name: str) -> None:
    """Add the adapter a `write_diffusers_lora` file holds (any peft type: LoKr and LoHa files, which
    diffusers' load_lora_weights refuses) to `denoiser` as `adapter_name`, with its recorded config."""
    from peft import set_peft_model_state_dict
    from peft.config import PeftConfig

    denoiser.add_adapter(PeftConfig.from_peft_type(**recorded_adapter(path, prefix)), adapter_name=adapter_name)
    tensors = {k.removeprefix(f"{prefix}."): v for k, v in load_file(path).items()}
    result = set_peft_model_state_dict(denoiser, tensors, adapter_name=adapter_name)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{path} does not match this model's adapter layers: unexpected {result.unexpected_keys[:3]}")
