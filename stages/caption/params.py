"""The caption stage's settings: keyed params (what a generated caption depends on) and unkeyed options."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lorapipe.cache.digest import digest_json

from ..contract import Frozen, library_majors

RECORD_VERSION = "1"  # in caption record keys: bump when a record's text would change for the same inputs


class CaptionParams(Frozen):
    """How captions are generated. The captioner is keyed by its folder's digest (CaptionInputs), never its path."""

    prompt: str | None = Field(None, min_length=1, description="what the captioner is asked; default: its kind's own"
                               " (Qwen-VL: a one-sentence description; Florence-2: its detailed-caption task)")
    max_new_tokens: int = Field(64, gt=0, description="the longest caption, in tokens")
    do_sample: bool = Field(False, description="sample instead of greedy decoding; seed, temperature and top_p"
                            " then keyed")
    seed: int = Field(0, description="seeds sampling (used only with do_sample)")
    temperature: float | None = Field(None, gt=0, description="with do_sample: the sampling temperature; default:"
                                      " the captioner's generation_config")
    top_p: float | None = Field(None, gt=0, le=1, description="with do_sample: nucleus sampling's probability mass;"
                                " default: the captioner's generation_config")
    num_beams: int | None = Field(None, gt=0, description="beams of the beam search; default: the captioner kind's"
                                  " documented one (Florence-2: 3; Qwen-VL: 1, greedy)")
    batch_size: int = Field(8, gt=0, description="images per generate() call; keyed: batched generation may round"
                            " differently")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the captioner's weights and"
                                                             " activations")

    @model_validator(mode="after")
    def _sampling_settings_sample(self) -> "CaptionParams":
        unused = [name for name in ("temperature", "top_p") if getattr(self, name) is not None]
        if unused and not self.do_sample:
            raise ValueError(f"{' and '.join(unused)} set but do_sample is false: set do_sample: true, or remove them")
        return self

    def generation(self) -> dict:
        """generate()'s arguments; the sampling ones only where set (else the model's generation_config's).
        num_beams: resolved to the captioner kind's default first (captioners.resolved)."""
        sampling = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
        return {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample, "num_beams": self.num_beams,
                **(sampling if self.do_sample else {})}

    def record_key(self, image_digest: str, captioner: str, prompt: str) -> str:
        """A caption record's key: the image's content, the captioner's identity, the prompt and every
        setting the text depends on; never the image's path (a renamed image costs nothing). One beam
        is what every record was generated with before num_beams existed: its keys stay as they were."""
        generation = {k: v for k, v in self.generation().items() if k != "num_beams" or v != 1}
        sampling = {"seed": self.seed} if self.do_sample else {}
        return digest_json({"image": image_digest, "captioner": captioner, "prompt": prompt, **generation, **sampling,
                            "batch_size": self.batch_size, "dtype": self.dtype, "version": RECORD_VERSION,
                            "libs": library_majors("torch", "transformers")})[:40]


class CaptionOptions(Frozen):
    progress_every: float = Field(10.0, ge=0, description="seconds between progress lines")
    shard_records: int = Field(256, gt=0, description="captions per shard of the sample store (a crash loses at"
                               " most one shard's)")
    num_processes: int = Field(1, ge=1, description="caption processes under accelerate launch (one per GPU),"
                               " used when more than one batch of images is missing; 1: this process")
