"""The encoded data format shared by encode (writer), train and evaluate (readers).

An encode artifact holds what training sees in `samples.json` (in its digest): for every sample
its split, caption, original size, crop box, size (samples of different buckets differ: batch by
size), repeats, `role: prior` for a prior dataset's sample (no role: train), and the keys of its
latent (and, with encode.flip, mirrored `latent_flip`) and text records, ordered by record keys, and
for an edit pair the latent records of its reference images (`references`, `references_flip`). With encode.caption_variants K > 1 a training sample also has
`text_variants` (K keys, `text` is the first) and `caption_variants` (their captions, to read). Where those records are kept lives in
`locations/index.json` (out of the digest, cache/store.py): each record's shard, offsets and
content digests, and each sample's id (its file) and dataset. So records moved to other shards,
or an image renamed, leave the artifact's digest and everything after it unchanged, and every
record read is checked against the digest recorded when it was written.

The header of samples.json holds the model family, the digests of the components that made the
records, the text options and the text settings they resolved to, the latent normalisation
(stages/families/latents.py) that train and evaluate apply to the unscaled posteriors, and with
caption variants the caption settings that made them (`caption_augmentation`).

Records are safetensors blobs (no pickle):
  latent record: "mean", "std"  (C, h, w) in the encode dtype; the VAE posterior, unscaled
  text record:   what the family's text encoder returns: "hidden_states" (T, D), and for SDXL and
                 Flux.1 "pooled" (D2,); variable-length families store (L_i, D) unpadded
  mask record:   "mask" (1, h, w) float32 loss weights at the latent record's h, w: only samples
                 with a loss mask have one (`mask`, and `mask_flip` with encode.flip)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from lorapipe.cache.errors import UserError
from lorapipe.cache.fsutil import write_json_rows
from lorapipe.cache.object_store import open_sample_store
from lorapipe.cache.samples import RecordLocation
from lorapipe.stages.families import TextOptions
from lorapipe.stages.families.base import REFERENCE_LATENTS
from lorapipe.stages.families.latents import normalisation_from_json

if TYPE_CHECKING:  # torch is imported where records are read or written, not by config loading
    import torch

FORMAT = 3  # 2: record locations and sample ids moved out of samples.json into locations/index.json;
# 3: the header holds text settings and the latent normalisation (it held SD's vae_scaling_factor)
SAMPLES_FILE = "samples.json"
LOCATIONS_FILE = "locations/index.json"


def encode_record(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, bytes]:
    from safetensors.torch import save as save_safetensors

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return {
        "safetensors": save_safetensors(tensors),
        "json": json.dumps(meta, sort_keys=True).encode(),
    }


def write_index(out_dir: Path, header: dict[str, Any], samples: Iterable[dict], sources: list[dict[str, str]],
                records: dict[str, RecordLocation]) -> None:
    """samples.json (format, header, samples) and locations/index.json (records by key, each
    sample's source in the same order)."""
    write_json_rows(out_dir / SAMPLES_FILE, {"format": FORMAT, **header}, "samples", samples)
    locations = out_dir / LOCATIONS_FILE
    locations.parent.mkdir(exist_ok=True)
    locations.write_text(json.dumps({"records": {key: loc.to_json() for key, loc in records.items()},
                                     "sources": sources}, sort_keys=True))


@dataclass(frozen=True, slots=True)
class Record:
    key: str
    location: RecordLocation


@dataclass(frozen=True, slots=True)
class Sample:
    id: str  # its file, as the dataset names it
    split: str  # "train" or "holdout"
    caption: str
    original_size: tuple[int, int]  # (height, width) of the source image
    crop_box: tuple[int, int, int, int]  # (left, top, right, bottom) in resized pixels
    size: tuple[int, int]  # (height, width) of the encoded image
    latent: Record
    text: Record
    repeats: int = 1  # how many times an epoch should show it (kohya-style dataset repeats)
    latent_flip: Record | None = None  # the mirrored image's posterior (encode.flip)
    dataset: str = ""  # the name of the dataset it came from
    resized: tuple[int, int] | None = None  # (height, width) before the crop; mirrors a flipped crop box
    text_variants: tuple[Record, ...] = ()  # encode.caption_variants > 1: every variant's (`text` is the first,
    # and in a batch plan's draw the one drawn: stages/train/data.py)
    mask: Record | None = None  # its loss mask (None: weight 1 everywhere)
    mask_flip: Record | None = None  # the mirrored image's loss mask (encode.flip)
    role: str = "train"  # "prior": a regularisation image of a dataset with role: prior (train.prior_loss_weight)
    frames: int = 0  # a clip's window: its frames (its latent record has a frame axis); 0: an image
    fps: float = 0.0  # a clip's window: the frames per second it was sampled at; 0: an image
    references: tuple[Record, ...] = ()  # its reference images' latent records, in order (an edit pair's)
    references_flip: tuple[Record, ...] = ()  # theirs mirrored (encode.flip)
    empty_text: Record | None = None  # its own empty prompt's record (read with its references), where the
    # text encoder reads them; None: the artifact's empty prompt

    @property
    def shape(self) -> tuple[int, int, int]:
        """(frames, height, width): samples of one shape batch together (frames 0: images)."""
        return (self.frames, *self.size)

    @property
    def content_id(self) -> str:
        """What the sample is, not where its file is: its latent record's key (image bytes, crop,
        VAE, ...). The batch plan's order and evaluate's noise follow it, so a rename changes neither."""
        return self.latent.key

    @classmethod
    def from_json(cls, v: dict, source: dict, records: dict[str, Record]) -> "Sample":
        return cls(
            source["id"], v["split"], v["caption"], tuple(v["original_size"]), tuple(v["crop_box"]), tuple(v["size"]),
            records[v["latent"]], records[v["text"]], v["repeats"],
            records[v["latent_flip"]] if "latent_flip" in v else None, source["dataset"], tuple(v["resized"]),
            tuple(records[key] for key in v.get("text_variants", ())),
            *(records[v[name]] if name in v else None for name in ("mask", "mask_flip")), v.get("role", "train"),
            v.get("frames", 0), v.get("fps", 0.0),
            *(tuple(records[key] for key in v.get(name, ())) for name in ("references", "references_flip")),
            records[v["empty_text"]] if "empty_text" in v else None,
        )


class EncodedData:
    """Read-only view of an encode artifact: its samples and their records in the sample store.
    Every record read is checked against its content digest (lorapipe.cache.samples.DamagedRecord if not)."""

    def __init__(self, artifact_dir: Path, cache_root: Path):
        artifact_dir = self.path = Path(artifact_dir)
        self.index = json.loads((artifact_dir / SAMPLES_FILE).read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{artifact_dir}/{SAMPLES_FILE}: encoded format {self.index.get('format')}, this"
                             f" lorapipe reads {FORMAT}: re-run encode")
        locations = json.loads((artifact_dir / LOCATIONS_FILE).read_text())
        records = {k: Record(k, RecordLocation.from_json(v)) for k, v in locations["records"].items()}
        self.store = open_sample_store(cache_root)  # on object storage: read through this host's shard cache
        self.samples = [Sample.from_json(v, source, records)  # not kept twice: popped from the index
                        for v, source in zip(self.index.pop("samples"), locations["sources"], strict=True)]
        self.empty = records.get(self.index["empty_text"])  # None: each sample has its own (Sample.empty_text)
        self.family: str = self.index["family"]
        self.models: dict[str, str] = self.index["models"]  # component -> weights digest
        self.normalisation = normalisation_from_json(self.index["normalisation"])
        self.text_options = TextOptions(**self.index["text_options"])  # what encode resolved into its text settings
        self.caption_augmentation: dict = self.index.get("caption_augmentation", {})  # encode.caption_variants > 1

    def split(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.split == name]

    def _tensors(self, record: Record) -> dict[str, torch.Tensor]:
        from safetensors.torch import load as load_safetensors

        return load_safetensors(self.store.read(record.key, record.location, "safetensors"))

    def latent(self, sample: Sample, flipped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The posterior's mean and std; `flipped`: of the mirrored image (needs encode.flip)."""
        if flipped and sample.latent_flip is None:
            raise ValueError(f"sample {sample.id} has no flipped latent: encode with encode.flip: true")
        t = self._tensors(sample.latent_flip if flipped else sample.latent)
        return t["mean"], t["std"]

    def reference_latents(self, sample: Sample, flipped: bool = False) -> torch.Tensor | None:
        """Its reference images' normalised posterior means (K, C, h, w); None: it has none."""
        conditioning = self.reference_conditioning(sample, flipped)
        return None if conditioning is None else conditioning[REFERENCE_LATENTS]

    def reference_conditioning(self, sample: Sample, flipped: bool = False) -> dict[str, torch.Tensor] | None:
        """Its reference images as the denoiser's conditioning: their posterior means (K, C, h, w) under
        the latent normalisation as REFERENCE_LATENTS, as edit pipelines encode their input images
        (argmax, not a sample), and what else their records hold (a conditioning image's embedding)
        under its own name, (K, ...); None: it has none."""
        import torch

        records = sample.references_flip if flipped else sample.references
        if not sample.references:
            return None
        tensors = [self._tensors(r) for r in records]
        means = self.normalisation.apply(torch.stack([t["mean"].float() for t in tensors]))
        return {REFERENCE_LATENTS: means, **{name: torch.stack([t[name].float() for t in tensors])
                                             for name in tensors[0] if name not in ("mean", "std")}}

    def mask(self, sample: Sample, flipped: bool = False) -> torch.Tensor | None:
        """The loss weights (1, h, w) of the (mirrored) latent, or None where the sample has no mask."""
        record = sample.mask_flip if flipped else sample.mask
        return None if record is None else self._tensors(record)["mask"]

    def text(self, sample: Sample) -> dict[str, torch.Tensor]:
        return self._tensors(sample.text)

    def empty_text(self, sample: Sample | None = None) -> dict[str, torch.Tensor]:
        """The empty prompt's embedding, used for caption dropout and unconditional loss: the sample's
        own where it has one (read with its references)."""
        record = sample.empty_text if sample is not None and sample.empty_text else self.empty
        if record is None:
            raise ValueError(f"{self.path}: no empty prompt record for {sample.id if sample else 'every sample'}")
        return self._tensors(record)

    def check_model(self, model: Path, family: str, components: dict[str, str]) -> None:
        """Refuse to train or evaluate `model` (of `family`, its components' digests) on records
        another model's encoders made: one line naming both."""
        made_by = {name: digest for name, digest in self.models.items() if components.get(name, digest) != digest}
        if family != self.family or made_by:
            ours = ", ".join(f"{name} {components[name][:12]}" for name in sorted(made_by)) or family
            theirs = ", ".join(f"{name} {digest[:12]}" for name, digest in sorted(made_by.items())) or self.family
            raise UserError(f"{self.path}: encoded by another model ({self.family}: {theirs}) than {model}"
                            f" ({family}: {ours}): re-run encode for this model")
