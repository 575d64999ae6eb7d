"""The pipeline evaluate renders with, for any model folder: a DiffusionPipeline from model_index.json,
or, for a model diffusers ships only as a modular pipeline (modular_model_index.json), its
ModularPipeline wrapped to be called as evaluate calls a DiffusionPipeline.

Either is loaded without the family's `render_left_out`: a DiffusionPipeline's optional components
that rendering a caption as trained never calls (ERNIE-Image's prompt enhancer, a language model as
large as its text encoder), a modular pipeline's sub-blocks (FLUX.3's prompt upsampler, a model no
checkpoint folder holds). A modular pipeline is built from its folder's blocks, its components loaded from the
folder; it takes one prompt per call (several images of it by num_images_per_prompt, a video
model's clips by num_videos_per_prompt) and reads its guidance scale from its guider component.
Everything else (its LoRA loader mixin's load_lora_weights, set_adapters, its components) is the
pipeline's own.
"""
from __future__ import annotations

from functools import partial
from itertools import groupby
from types import SimpleNamespace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .folders import INDEX_FILES, index_file, model_index

if TYPE_CHECKING:
    import torch

    from .base import Family


def load_render_pipeline(model_path: Path, family: Family, dtype: torch.dtype | dict[str, torch.dtype] | None,
                         device: str) -> Any:
    """The folder's pipeline on `device`, its components in `dtype` (one for all, or by component with
    a "default"; None: as diffusers loads them), its progress bars off, its text encoders' outputs
    handed on in the denoiser's dtype (`computing_in_denoiser_dtype`)."""
    if index_file(model_path).name == INDEX_FILES[0]:
        import diffusers

        # the folder's own class, not DiffusionPipeline's from_pretrained: only the class knows which
        # of its components are optional, and a component given as None is left out only if optional
        pipeline_class = getattr(diffusers, model_index(model_path)["_class_name"])
        left_out = dict.fromkeys(family.render_left_out)
        pipe = pipeline_class.from_pretrained(model_path, dtype=dtype, **left_out).to(device)
    else:
        pipe = ModularRenderer(model_path, family.render_left_out, dtype, family.video).to(device)
    pipe.set_progress_bar_config(disable=True)
    computing_in_denoiser_dtype(pipe, family)
    return pipe


def computing_in_denoiser_dtype(pipe: Any, family: Family) -> None:
    """A pipeline whose text encoders keep a dtype of their own (a bf16 text encoder beside a float32
    denoiser: each as stored) made to run: each text module hands its outputs on in the denoiser's
    dtype, and every model takes its inputs in its own dtype, a VAE's children too (decode and encode
    are not its forward). Pipelines cast embeddings back to their text encoder's dtype and draw
    latents in it; a model given them computes in its own. A pipeline in one dtype is left as it is."""
    import torch

    dtypes = {name: dtype for name, component in pipe.components.items()
              if isinstance(component, torch.nn.Module) and (dtype := _computing_dtype(component))}
    if len(set(dtypes.values())) < 2:
        return  # one dtype: the pipeline as diffusers runs it
    denoiser_dtype = dtypes[family.components.denoiser]
    for name, dtype in dtypes.items():
        component = pipe.components[name]
        for module in (component, *(component.children() if name not in family.components.text else ())):
            module.register_forward_pre_hook(partial(_inputs_in, dtype), with_kwargs=True)
        if name in family.components.text:
            component.register_forward_hook(lambda _, args, output: _cast(output, denoiser_dtype))


def _computing_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """Its first floating parameter's dtype (None: it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def _inputs_in(dtype: torch.dtype, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The module's floating tensor arguments in `dtype`; nothing inside a container, which may be state the
    module fills in place (Wan's VAE passes its causal-convolution cache as lists)."""
    return tuple(_cast_tensor(value, dtype) for value in args), {k: _cast_tensor(v, dtype) for k, v in kwargs.items()}


def _cast_tensor(value: Any, dtype: torch.dtype) -> Any:
    """`value` in `dtype` if it is a floating tensor, else as it is."""
    import torch

    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in `value` (a tensor, or tuples, lists and dicts of them: a model output) in `dtype`."""
    if isinstance(value, dict):  # a ModelOutput too: its fields set in place keep its class and attributes
        for key, item in value.items():
            value[key] = _cast(item, dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(item, dtype) for item in value)
    return _cast_tensor(value, dtype)


class ModularRenderer:
    """A ModularPipeline called as a DiffusionPipeline: prompt lists, a guidance_scale argument, images
    (or a video model's frames) as its output's first field."""

    def __init__(self, model_path: Path, left_out: tuple[str, ...], dtype: torch.dtype | None, video: bool):
        from diffusers.modular_pipelines import ModularPipeline

        blocks = ModularPipeline.from_pretrained(str(model_path)).blocks  # a str: diffusers splits it
        for name in left_out:
            blocks.sub_blocks.pop(name)
        self.pipe = blocks.init_pipeline(str(model_path))
        self.pipe.load_components(dtype=dtype)
        self.output = "videos" if video else "images"
        self.per_prompt = "num_videos_per_prompt" if video else "num_images_per_prompt"  # the blocks' input

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["pipe"], name)

    def to(self, device: str) -> ModularRenderer:
        self.pipe.to(device)
        return self

    def __call__(self, prompt: list[str], generator: list[torch.Generator], guidance_scale: float | None = None,
                 negative_prompt: list[str] | None = None, output_type: str = "pil", **kwargs: Any) -> Any:
        """One pipeline call per run of equal prompts, with their generators; its images, or frames."""
        if guidance_scale not in (None, self.pipe.guider.guidance_scale):
            self.pipe.update_components(guider=self.pipe.guider.new(guidance_scale=guidance_scale))
        negatives = negative_prompt or [None] * len(prompt)
        outputs, start = [], 0
        for (text, negative), run in groupby(zip(prompt, negatives)):
            count = len(list(run))
            outputs += self.pipe(prompt=text, negative_prompt=negative, generator=generator[start:start + count],
                                 output_type=output_type, output=self.output, **{self.per_prompt: count}, **kwargs)
            start += count
        return SimpleNamespace(frames=outputs) if self.output == "videos" else (outputs,)
