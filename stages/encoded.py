"""The encoded data format shared by encode (writer), train and evaluate (readers).

The encode artifact holds one data file, `samples.json`: for every sample its split, caption,
original size, crop box, size (samples of different buckets differ: batch by size), repeats,
dataset name, and the keys and shard locations of its latent (and, with encode.flip, mirrored
`latent_flip`) and text records in the sample store. Records are safetensors blobs (no pickle):
  latent record: "mean", "std"  (C, h, w) in the encode dtype; the VAE posterior, unscaled
  text record:   "hidden_states" (T, D); SDXL adds "pooled" (D2,)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cache.samples import RecordLocation, SampleStore

if TYPE_CHECKING:  # torch is imported where records are read or written, not by config loading
    import torch

FORMAT = 1
SAMPLES_FILE = "samples.json"


def encode_record(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, bytes]:
    from safetensors.torch import save as save_safetensors

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return {
        "safetensors": save_safetensors(tensors),
        "json": json.dumps(meta, sort_keys=True).encode(),
    }


@dataclass(frozen=True, slots=True)
class Sample:
    id: str
    split: str  # "train" or "holdout"
    caption: str
    original_size: tuple[int, int]  # (height, width) of the source image
    crop_box: tuple[int, int, int, int]  # (left, top, right, bottom) in resized pixels
    size: tuple[int, int]  # (height, width) of the encoded image
    latent: RecordLocation
    text: RecordLocation
    repeats: int = 1  # how many times an epoch should show it (kohya-style dataset repeats)
    latent_flip: RecordLocation | None = None  # the mirrored image's posterior (encode.flip)
    dataset: str = ""  # the name of the dataset it came from
    resized: tuple[int, int] | None = None  # (height, width) before the crop; mirrors a flipped crop box

    @classmethod
    def from_json(cls, v: dict) -> "Sample":
        flip = v.get("latent_flip")
        return cls(
            v["id"], v["split"], v["caption"], tuple(v["original_size"]), tuple(v["crop_box"]),
            tuple(v["size"]), RecordLocation.from_json(v["latent"]["location"]),
            RecordLocation.from_json(v["text"]["location"]), v.get("repeats", 1),
            RecordLocation.from_json(flip["location"]) if flip else None, v.get("dataset", ""),
            tuple(v["resized"]) if "resized" in v else None,
        )


class EncodedData:
    """Read-only view of an encode artifact: its index and its records in the sample store."""

    def __init__(self, artifact_dir: Path, cache_root: Path):
        self.index = json.loads((Path(artifact_dir) / SAMPLES_FILE).read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{artifact_dir}/{SAMPLES_FILE}: unsupported encoded format {self.index.get('format')}")
        self.store = SampleStore(cache_root)
        self.samples = [Sample.from_json(s) for s in self.index.pop("samples")]  # not kept twice
        self.family: str = self.index["family"]
        self.models: dict[str, str] = self.index["models"]  # component -> weights digest

    def split(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.split == name]

    def _tensors(self, location: RecordLocation) -> dict[str, torch.Tensor]:
        from safetensors.torch import load as load_safetensors

        return load_safetensors(self.store.read(location, "safetensors"))

    def latent(self, sample: Sample, flipped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The posterior's mean and std; `flipped`: of the mirrored image (needs encode.flip)."""
        if flipped and sample.latent_flip is None:
            raise ValueError(f"sample {sample.id} has no flipped latent: encode with encode.flip: true")
        t = self._tensors(sample.latent_flip if flipped else sample.latent)
        return t["mean"], t["std"]

    def text(self, sample: Sample) -> dict[str, torch.Tensor]:
        return self._tensors(sample.text)

    def empty_text(self) -> dict[str, torch.Tensor]:
        """The empty prompt's embedding, used for caption dropout and unconditional loss."""
        return self._tensors(RecordLocation.from_json(self.index["empty_text"]["location"]))

    def check_model(self, components: dict[str, str]) -> None:
        """Refuse to use latents or embeddings made by other weights than `components`."""
        for name, digest in components.items():
            if name in self.models and self.models[name] != digest:
                raise ValueError(
                    f"encoded data was made with another {name} ({self.models[name][:12]}) than this model"
                    f" ({digest[:12]}): re-run encode for this model"
                )
