"""One component file converted into a diffusers component folder over a base model.

A user's file holds one component (a ComfyUI `diffusion_models/` transformer, a VAE, a text
encoder) or a whole A1111 checkpoint, in the original layout (BFL, Wan, LTX, LDM), maybe under
ComfyUI's `model.diffusion_model.` prefix, or already in the diffusers/transformers class's names,
maybe in fp8 (fp8_weights.py). `convert_component` writes what `from_pretrained` reads: the base's
config.json and the weights in the base class's names, sharded with an index when large. The
names come from diffusers' own converter for the class, called as its `from_single_file` calls it,
so the result is what diffusers would load; a family supplies a converter of its own only where
diffusers' assumes full sizes (Family.size_free_converters). Every tensor is then checked against
the model the base's config builds (on the meta device): nothing missing, nothing left over, equal
shapes. Text encoders (transformers classes) keep their names and are checked by loading.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lorapipe.cache.errors import UserError
from lorapipe.stages.contract import Log
from lorapipe.stages.families import Family
from lorapipe.stages.families.folders import check_weights_file, component_class, component_config

from .fp8_weights import dequantised

if TYPE_CHECKING:
    import torch

COMFYUI_PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # a denoiser's, in ComfyUI's files
MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default


def convert_component(family: Family, component: str, file: Path, base: Path, target: Path, log: Log) -> None:
    """Write `target`, the diffusers folder of `base`'s `component` with the weights of `file`;
    UserError in one line naming the file and the config key for a file that does not fit (a text
    encoder is refused after it is written: the caller writes `target` in a staging folder)."""
    import transformers

    cls = component_class(base, component)
    is_text_encoder = issubclass(cls, transformers.PreTrainedModel)
    key = "model.text_encoders" if is_text_encoder else f"model.{component}"
    names = _whole_file_names(file, key)
    tensors = _own_tensors(file, names, _prefixes(family, component))
    tensors = dequantised(tensors, file, log)
    expected = _empty_state(cls, base, component, is_text_encoder)
    if not is_text_encoder and not set(tensors) <= set(expected):  # not (only) the class's own names
        tensors = _diffusers_names(tensors, family, component, cls, component_config(base, component), file, key)
    _check(tensors, expected, file, key, partial=is_text_encoder)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(base / component / "config.json", target / "config.json")
    write_sharded(tensors, target, "model" if is_text_encoder else "diffusion_pytorch_model")
    if is_text_encoder:
        _check_loads(cls, target, file, key)


def _whole_file_names(file: Path, key: str) -> set[str]:
    """The tensor names of `file`, a whole safetensors file, or UserError naming the key."""
    if not file.is_file():
        raise UserError(f"{key}: {file} not found")
    try:
        return check_weights_file(file)
    except UserError as e:
        raise UserError(f"{key}: {e}") from None


def _prefixes(family: Family, component: str) -> tuple[str, ...]:
    """The prefixes a file may put before the component's names: the family's for it in a whole
    checkpoint, and for a denoiser ComfyUI's."""
    own = (family.checkpoint_prefixes[component],) if component in family.checkpoint_prefixes else ()
    comfyui = COMFYUI_PREFIXES if component in family.components.denoisers() else ()
    return tuple(dict.fromkeys((*own, *comfyui)))


def _own_tensors(file: Path, names: set[str], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The file's tensors under the longest of `prefixes` that some name has, the prefix stripped,
    read alone (a whole checkpoint's other components are not read); all of them where none has one."""
    from safetensors import safe_open

    prefix = next((p for p in sorted(prefixes, key=len, reverse=True) if any(n.startswith(p) for n in names)), "")
    with safe_open(file, "pt") as f:
        return {name[len(prefix):]: f.get_tensor(name) for name in sorted(names) if name.startswith(prefix)}


def _diffusers_names(tensors: dict[str, torch.Tensor], family: Family, component: str, cls: type, config: dict,
                     file: Path, key: str) -> dict[str, torch.Tensor]:
    """The tensors in the diffusers class's names, by the family's size-free converter or diffusers'
    own (which reads the names under the family's whole-checkpoint prefix)."""
    size_free = family.size_free_converters.get(component)
    prefix = family.checkpoint_prefixes.get(component, "")
    try:
        if size_free is not None:
            return size_free(tensors, config)
        checkpoint = {prefix + name: t for name, t in tensors.items()}
        return _diffusers_converter(cls, file, key)(checkpoint=checkpoint, config=config)
    except (KeyError, IndexError, ValueError, RuntimeError) as e:
        raise UserError(f"{key}: {file} is not a {cls.__name__} in a layout diffusers converts"
                        f" ({type(e).__name__}: {e})") from None


def _diffusers_converter(cls: type, file: Path, key: str) -> Callable[..., dict]:
    """diffusers' single-file converter for `cls` (a subclass of one of its loadable classes)."""
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    for name, functions in SINGLE_FILE_LOADABLE_CLASSES.items():
        if issubclass(cls, getattr(diffusers, name)):
            return functions["checkpoint_mapping_fn"]
    raise UserError(f"{key}: {file} is not in {cls.__name__}'s diffusers names, and diffusers converts no other"
                    f" layout of it: give a diffusers-format folder")


def _empty_state(cls: type, base: Path, component: str, is_text_encoder: bool) -> dict[str, Any]:
    """The state dict (on the meta device) of the model the base's config builds."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        if is_text_encoder:
            model = cls(cls.config_class.from_pretrained(base / component))
        else:
            model = cls.from_config(component_config(base, component))
    return model.state_dict()


def _check(tensors: dict[str, torch.Tensor], expected: dict[str, Any], file: Path, key: str, partial: bool) -> None:
    """Refuse a tensor missing, left over or of another shape than the model's; `partial`: only
    shapes (a text encoder's tied weights are left out of files, its loading says what is missing)."""
    for name in sorted(set(tensors) & set(expected)):
        if tensors[name].shape != expected[name].shape:
            raise UserError(f"{key}: {file}: {name} has shape {tuple(tensors[name].shape)}, the base model's"
                            f" {tuple(expected[name].shape)}: the file is another size of model than the base")
    if partial:
        return
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing:
        raise UserError(f"{key}: {file} has no {missing[0]} ({len(missing)} tensors missing): not a whole"
                        f" component of the base's kind")
    if extra:
        raise UserError(f"{key}: {file} has {extra[0]}, which the base's component has not ({len(extra)}"
                        f" tensors left over): not a component of the base's kind")


def _check_loads(cls: type, target: Path, file: Path, key: str) -> None:
    """Load the written text encoder; refuse it when transformers reports missing or unexpected keys."""
    _, info = cls.from_pretrained(target, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys"):
        if info[kind]:
            names = sorted(info[kind])
            raise UserError(f"{key}: {file}: {kind.replace('_', ' ')} loading it as {cls.__name__}: {names[0]}"
                            f" ({len(names)} in all)")


def write_sharded(tensors: dict[str, torch.Tensor], target: Path, stem: str,
                  max_shard_size: str = MAX_SHARD_SIZE) -> None:
    """`tensors` as `<stem>.safetensors`, or shards and `<stem>.safetensors.index.json` when large,
    as diffusers' and transformers' save_pretrained name them; one shard copied at a time."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(tensors, filename_pattern=stem + "{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for shard, names in split.filename_to_tensors.items():
        save_file({name: tensors[name].clone() for name in names}, target / shard, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (target / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
