"""Encode: pixels -> VAE posteriors and text-encoder hidden states, as records in the sample store.

Reads:  the preprocess artifact (dataset.json) and the images it names, the model's VAE,
        tokenizer(s) and text encoder(s).
Writes: samples.json (stages/encoded.py), an index into shards of the sample store; each
        sample's latent and text records are keyed by what they depend on, so only records that
        do not exist yet are computed (a caption edit encodes one text record and no latent).
Key:    these params + the preprocess artifact's digest + VAE / tokenizer / text-encoder digests.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from PIL import Image, ImageOps
from pydantic import Field

from cache.digest import digest_json
from cache.samples import SampleStore
from cache.store import Built

from .contract import Frozen, Log, library_majors
from .encoded import FORMAT, SAMPLES_FILE, encode_record
from .preprocess import DATASET_FILE

if TYPE_CHECKING:  # torch is imported where encoding happens, not by config loading
    import torch

VERSION = "1"


class EncodeParams(Frozen):
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class EncodeOptions(Frozen):
    batch_size: int = Field(8, gt=0)
    num_workers: int = Field(1, ge=0, description="DataLoader processes decoding images")
    shard_records: int = Field(256, gt=0, description="records per shard (a crash loses at most one shard)")


@dataclass(frozen=True)
class EncodeInputs:
    preprocess_dir: Path
    dataset_dir: Path
    cache_root: Path
    model_path: Path
    family: str
    model_digests: dict[str, str]


def latent_key(sample: dict, params: EncodeParams, vae_digest: str) -> str:
    return digest_json({
        "image": sample["digest"], "resized": sample["resized"], "crop_box": sample["crop_box"],
        "flip": False, "dtype": params.dtype, "vae": vae_digest, "version": VERSION,
        "libs": library_majors("torch", "diffusers"),
    })[:40]


def text_key(caption: str, params: EncodeParams, inputs: EncodeInputs) -> str:
    encoders = {k: v for k, v in inputs.model_digests.items() if k.startswith(("text_encoder", "tokenizer"))}
    return digest_json({
        "caption": caption, "encoders": encoders, "family": inputs.family, "dtype": params.dtype,
        "version": VERSION, "libs": library_majors("torch", "transformers"),
    })[:40]


class ImageCrops:
    """A map-style dataset that decodes, orients, converts to RGB, resizes and crops one image
    (runs in DataLoader workers)."""

    def __init__(self, dataset_dir: Path, samples: list[dict]):
        self.dataset_dir, self.samples = dataset_dir, samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | None, str]:
        """(index, pixels in [-1, 1] or None, why it failed): a broken file is reported, not raised."""
        import torch

        s = self.samples[i]
        try:
            with Image.open(self.dataset_dir / s["path"]) as im:
                im = ImageOps.exif_transpose(im).convert("RGB")
                h, w = s["resized"]
                im = im.resize((w, h), Image.BICUBIC).crop(tuple(s["crop_box"]))
                pixels = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
        except (OSError, ValueError, SyntaxError) as e:
            return i, None, f"cannot decode ({type(e).__name__}: {e})"
        return i, pixels.view(im.height, im.width, 3).permute(2, 0, 1).float() / 127.5 - 1.0, ""


class RecordBuffer:
    """Collects new records and commits them to the sample store shard by shard."""

    def __init__(self, store: SampleStore, shard_records: int):
        self.store, self.shard_records, self.pending = store, shard_records, {}

    def add(self, key: str, record: dict[str, bytes]) -> None:
        self.pending[key] = record
        if len(self.pending) >= self.shard_records:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.store.write_shard(self.pending)
            self.pending = {}


class TextEncoder:
    """The model family's prompt encoder: SD1.x/2.x last hidden state; SDXL both encoders'
    penultimate hidden states concatenated, plus the second encoder's pooled embedding."""

    def __init__(self, model_path: Path, family: str, dtype: torch.dtype):
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        self.family, self.dtype = family, dtype
        load_tok = lambda sub: CLIPTokenizer.from_pretrained(model_path, subfolder=sub)  # noqa: E731
        self.pairs = [(load_tok("tokenizer"), CLIPTextModel.from_pretrained(model_path, subfolder="text_encoder"))]
        if family == "sdxl":
            self.pairs.append((load_tok("tokenizer_2"), CLIPTextModelWithProjection.from_pretrained(
                model_path, subfolder="text_encoder_2")))
        for _, model in self.pairs:
            model.eval().requires_grad_(False)

    def too_long(self, caption: str) -> bool:
        tokenizer = self.pairs[0][0]
        return len(tokenizer(caption).input_ids) > tokenizer.model_max_length

    def __call__(self, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        import torch

        hidden, pooled = [], None
        for tokenizer, model in self.pairs:
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            with torch.inference_mode():
                out = model(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2] if self.family == "sdxl" else out.last_hidden_state)
            if self.family == "sdxl" and hasattr(out, "text_embeds"):  # the projection encoder
                pooled = out.text_embeds
        states = torch.cat(hidden, dim=-1).to(self.dtype)
        records = [{"hidden_states": states[i]} for i in range(len(captions))]
        if pooled is not None:
            for i, r in enumerate(records):
                r["pooled"] = pooled[i].to(self.dtype)
        return records


def _encode_texts(captions: dict[str, tuple[str, str]], inputs: EncodeInputs, dtype: torch.dtype,
                  buffer: RecordBuffer, batch_size: int, log: Log) -> None:
    """captions: text record key -> (caption, sample id), only those not yet in the store."""
    if not captions:
        return
    encoder = TextEncoder(inputs.model_path, inputs.family, dtype)
    for caption, sample_id in captions.values():
        if encoder.too_long(caption):
            log(f"encode: warning: the caption of {sample_id} is longer than the text encoder's window;"
                " it is truncated")
    items = sorted((key, caption) for key, (caption, _) in captions.items())
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        for (key, caption), tensors in zip(batch, encoder([c for _, c in batch])):
            buffer.add(key, encode_record(tensors, {"caption": caption}))


def _encode_latents(todo: list[tuple[str, dict]], inputs: EncodeInputs, dtype: torch.dtype,
                    buffer: RecordBuffer, options: EncodeOptions, log: Log) -> dict[str, str]:
    """todo: (latent record key, preprocess sample) for latents not yet in the store.
    Returns the images that could not be decoded: path -> reason."""
    failed: dict[str, str] = {}
    if not todo:
        return failed
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(inputs.model_path, subfolder="vae").eval().requires_grad_(False)
    # spawn, not fork: the Prefect host process is multi-threaded and forked workers died in it
    workers = min(options.num_workers, len(todo) // options.batch_size)
    loader = torch.utils.data.DataLoader(
        ImageCrops(inputs.dataset_dir, [s for _, s in todo]), batch_size=options.batch_size,
        num_workers=workers, multiprocessing_context="spawn" if workers else None, collate_fn=list,
    )
    done = 0
    with torch.inference_mode():
        for batch in loader:
            for i, _, reason in (item for item in batch if item[1] is None):
                failed[todo[i][1]["path"]] = reason
                log(f"encode: skipped {todo[i][1]['path']}: {reason}")
            good = [(i, pixels) for i, pixels, _ in batch if pixels is not None]
            if good:
                posterior = vae.encode(torch.stack([p for _, p in good])).latent_dist
                for row, (i, _) in enumerate(good):
                    key, sample = todo[i]
                    tensors = {"mean": posterior.mean[row].to(dtype), "std": posterior.std[row].to(dtype)}
                    buffer.add(key, encode_record(tensors, {"image": sample["digest"]}))
            done += len(batch)
            log(f"encode: {done}/{len(todo)} images")
    return failed


def run(params: EncodeParams, inputs: EncodeInputs, out_dir: Path, work_dir: Path,
        options: EncodeOptions, log: Log = print) -> Built:
    import torch

    dataset = json.loads((inputs.preprocess_dir / DATASET_FILE).read_text())["samples"]
    store = SampleStore(inputs.cache_root)
    dtype = getattr(torch, params.dtype)
    latent_keys = {s["id"]: latent_key(s, params, inputs.model_digests["vae"]) for s in dataset}
    text_keys = {s["id"]: text_key(s["caption"], params, inputs) for s in dataset}
    empty_key = text_key("", params, inputs)
    missing = set(store.missing([*latent_keys.values(), *text_keys.values(), empty_key]))
    buffer = RecordBuffer(store, options.shard_records)
    captions = {text_keys[s["id"]]: (s["caption"], s["path"]) for s in dataset if text_keys[s["id"]] in missing}
    if empty_key in missing:
        captions[empty_key] = ("", "the empty prompt")
    _encode_texts(captions, inputs, dtype, buffer, options.batch_size, log)
    todo = sorted({latent_keys[s["id"]]: s for s in dataset if latent_keys[s["id"]] in missing}.items())
    failed = _encode_latents(todo, inputs, dtype, buffer, options, log)
    buffer.flush()
    usable = [s for s in dataset if s["path"] not in failed]
    if not usable:
        raise ValueError(f"encode: none of the {len(dataset)} images in {inputs.dataset_dir} could be decoded")
    refs = _write_index(out_dir, usable, latent_keys, text_keys, empty_key, store, params, inputs)
    (out_dir / "report.json").write_text(json.dumps({"undecodable": failed}, indent=1, sort_keys=True))
    counts = {
        "latents_encoded": len(todo) - len(failed), "latents_reused": len(set(latent_keys.values())) - len(todo),
        "texts_encoded": len(captions), "texts_reused": len(set(text_keys.values()) | {empty_key}) - len(captions),
        "undecodable": len(failed),
    }
    log("encode: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return Built(info=counts, refs=refs)


def _write_index(out_dir: Path, dataset: list[dict], latent_keys: dict[str, str], text_keys: dict[str, str],
                 empty_key: str, store: SampleStore, params: EncodeParams, inputs: EncodeInputs) -> dict:
    """Write samples.json; return the shards it points into as artifact refs (size, digest)."""
    index = store.index()
    entry = lambda key: {"key": key, "location": index[key].to_json()}  # noqa: E731
    samples = [{
        "id": s["id"], "split": s["split"], "caption": s["caption"], "original_size": s["original_size"],
        "crop_box": s["crop_box"], "size": s["size"], "latent": entry(latent_keys[s["id"]]),
        "text": entry(text_keys[s["id"]]),
    } for s in dataset]
    (out_dir / SAMPLES_FILE).write_text(json.dumps({
        "format": FORMAT, "family": inputs.family, "dtype": params.dtype, "models": inputs.model_digests,
        "vae_scaling_factor": _vae_scaling_factor(inputs.model_path), "empty_text": entry(empty_key),
        "samples": samples,
    }, indent=1, sort_keys=True))
    refs = {}
    for shard in sorted({index[e[k]["key"]].shard for e in samples for k in ("latent", "text")} | {index[empty_key].shard}):
        meta = store.shard_meta(shard)
        refs[f"samples/{shard}.tar"] = {"size": meta["size"], "digest": meta["digest"]}
    return refs


def _vae_scaling_factor(model_path: Path) -> float:
    return json.loads((model_path / "vae" / "config.json").read_text()).get("scaling_factor", 0.18215)
