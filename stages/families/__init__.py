"""Model families: the registry of model lines (`FAMILIES`; each one's values in the table of
docs/adding-a-family.md, generated from it) and `for_model`, which finds a model's family (a folder
by its pipeline class, a single file by its tensor names) and binds it to the model's variant. What
a family provides, and which stage uses what: the docstring of base.Family, the seam. Adding a
family: docs/adding-a-family.md.
"""
from __future__ import annotations

from pathlib import Path

from lorapipe.cache.errors import UserError

from .base import ALL_LINEAR, BOTH_DENOISERS, Components, Family, TextOptions, check_references, swappable_blocks
from .chroma import CHROMA
from .ernie_image import ERNIE_IMAGE
from .flux1 import FLUX1, FLUX1_KONTEXT
from .flux2 import FLUX2_KLEIN
from .flux2_dev import FLUX2_DEV
from .flux3 import FLUX3
from .folders import check_weights_file, index_file, is_single_file, model_index
from .hidream import HIDREAM
from .hunyuanimage21 import HUNYUANIMAGE21
from .hunyuanvideo15 import HUNYUANVIDEO15
from .hunyuanvideo15_i2v import HUNYUANVIDEO15_I2V
from .ideogram4 import IDEOGRAM4
from .kandinsky5 import KANDINSKY5
from .kandinsky5_i2v import KANDINSKY5_I2V
from .kandinsky5_video import KANDINSKY5_VIDEO
from .krea2 import KREA2
from .ltx2 import LTX2
from .ltx2_i2v import LTX2_I2V
from .ltx25 import LTX25
from .objectives import ObjectiveParams, TimestepSampling
from .qwenimage import QWEN_IMAGE
from .qwenimage21 import QWEN_IMAGE_21
from .qwenimage_edit import QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS
from .sd import SD15, SDXL
from .single_file import single_file_folder
from .wan import WAN
from .wan_i2v import WAN_I2V
from .zimage import ZIMAGE

FAMILIES: dict[str, Family] = {family.name: family for family in (SD15, SDXL, FLUX1, FLUX1_KONTEXT, FLUX2_KLEIN,
                                                                  FLUX2_DEV, FLUX3,
                                                                  ZIMAGE, QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS,
                                                                  QWEN_IMAGE_21, KREA2, IDEOGRAM4, WAN, WAN_I2V, LTX2,
                                                                  LTX2_I2V, LTX25, HUNYUANVIDEO15, HUNYUANVIDEO15_I2V,
                                                                  ERNIE_IMAGE, HUNYUANIMAGE21, CHROMA, HIDREAM, KANDINSKY5,
                                                                  KANDINSKY5_VIDEO, KANDINSKY5_I2V)}
DENOISER_NAMES = tuple(dict.fromkeys(name for family in FAMILIES.values() for name in family.denoiser_names))
# single files: SDXL's marker before SD1.x's, which SDXL checkpoints also carry; Flux.2's and Chroma's before
# Flux.1's, whose markers their checkpoints also carry
SINGLE_FILE_DETECTION = (SDXL, SD15, FLUX2_KLEIN, FLUX3, CHROMA, FLUX1, ZIMAGE, QWEN_IMAGE, QWEN_IMAGE_21, KREA2, WAN, LTX2,
                         ERNIE_IMAGE, HIDREAM)

__all__ = ["ALL_LINEAR", "BOTH_DENOISERS", "Components", "DENOISER_NAMES", "FAMILIES", "Family", "ObjectiveParams",
           "TextOptions", "TimestepSampling", "build_tiny_model", "check_references", "for_model", "get",
           "is_single_file", "single_file_folder",
           "swappable_blocks", "tiny_arches"]


def get(name: str) -> Family:
    """The registered family `name` (not yet bound to a model's variant: see for_model)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: expected one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def for_model(model_path: Path, declared: str | None = None) -> Family:
    """The family of a diffusers folder (from its pipeline class) or of a single-file checkpoint
    (declared, or from its tensor names), bound to the model's variant. `declared` is
    model.family: for a folder it must agree."""
    model_path = Path(model_path)
    if is_single_file(model_path):
        return get(declared) if declared else single_file_family(model_path)
    name = model_index(model_path).get("_class_name")
    family = next((f for f in FAMILIES.values() if f.pipeline_class == name), None)
    if family is None:
        supported = ", ".join(f.pipeline_class for f in FAMILIES.values())
        raise UserError(f"{index_file(model_path)}: unsupported pipeline class {name!r} (supported: {supported})")
    if declared and declared != family.name:
        raise ValueError(f"model.family is {declared} but {index_file(model_path)} is a {family.name} model")
    return family.for_model(model_path)


def single_file_family(path: Path) -> Family:
    """The family whose marker tensor the checkpoint holds (read from its header only, without torch)."""
    if not Path(path).is_file():
        raise UserError(f"model.path: {path} is not a file")
    names = check_weights_file(Path(path))
    family = next((f for f in SINGLE_FILE_DETECTION if names & set(f.single_file_markers)), None)
    if family is None:
        raise ValueError(f"model.path: {path} holds none of the tensors that identify a {', '.join(FAMILIES)}"
                         " checkpoint in the original layout; give a diffusers folder or a Hugging Face repo id"
                         " (a denoiser file goes over it in model.transformer), or set model.family")
    return family


def tiny_arches() -> dict[str, Family]:
    """`lorapipe tiny-model --arch` names -> the family that builds them; the first is the default."""
    return {variant.tiny_arch: family for family in FAMILIES.values() for variant in family.variants}


TINY_CAPTIONER = "captioner"  # `lorapipe tiny-model --arch captioner`: the caption stage's tiny model, not a family's


def tiny_model_names() -> list[str]:
    """Every `lorapipe tiny-model --arch` name: the families' tiny models (the first the default), then the captioner."""
    return [*tiny_arches(), TINY_CAPTIONER]


def build_tiny_model(out_dir: Path, arch: str = "sd15") -> Path:
    if arch == TINY_CAPTIONER:
        from .tiny.captioner import build_tiny_captioner

        return build_tiny_captioner(Path(out_dir))
    arches = tiny_arches()
    if arch not in arches:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(tiny_model_names())}")
    return arches[arch].build_tiny(Path(out_dir), arch)
