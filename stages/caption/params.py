"""The caption stage's settings: keyed params (what a generated caption depends on) and unkeyed options."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from lorapipe.cache.digest import digest_json

from ..contract import Frozen, library_majors

RECORD_VERSION = "1"  # in caption record keys: bump when a record's text would change for the same inputs


class CaptionParams(Frozen):
    """How captions are generated. The captioner is keyed by its folder's digest (CaptionInputs), never its path."""

    prompt: str | None = Field(None, min_length=1, description="what the captioner is asked; default: its kind's own"
                               " (Qwen-VL: a one-sentence description; Florence-2: its detailed-caption task)")
    max_new_tokens: int = Field(64, gt=0, description="the longest caption, in tokens")
    do_sample: bool = Field(False, description="sample instead of greedy decoding (the model's generation_config"
                            " sets temperature and top_p); seed then keyed")
    seed: int = Field(0, description="seeds sampling (used only with do_sample)")
    batch_size: int = Field(8, gt=0, description="images per generate() call; keyed: batched generation may round"
                            " differently")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the captioner's weights and"
                                                             " activations")

    def record_key(self, image_digest: str, captioner: str, prompt: str) -> str:
        """A caption record's key: the image's content, the captioner's identity, the prompt and every
        setting the text depends on; never the image's path (a renamed image costs nothing)."""
        sampling = {"seed": self.seed} if self.do_sample else {}
        return digest_json({"image": image_digest, "captioner": captioner, "prompt": prompt,
                            "max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample, **sampling,
                            "batch_size": self.batch_size, "dtype": self.dtype, "version": RECORD_VERSION,
                            "libs": library_majors("torch", "transformers")})[:40]


class CaptionOptions(Frozen):
    progress_every: float = Field(10.0, ge=0, description="seconds between progress lines")
    shard_records: int = Field(256, gt=0, description="captions per shard of the sample store (a crash loses at"
                               " most one shard's)")
