"""Caption (optional, configured by a `caption:` section): generated captions for the images whose
dataset's caption_policy asks for one, between preprocess and encode.

Reads:  the preprocess artifact (dataset.json, report.json), the images it names (whole and upright,
        as the user sees them), the captioner (a local transformers folder: captioners.py).
Writes: dataset.json: preprocess's format and samples, each caption final (encode reads it as it
        reads preprocess's); captions.json: the captioner (kind, digest, prompt, settings) and per
        sample its final caption, where it came from (written, generated, replace, prefix, suffix,
        combine), the written and generated captions, the record key, path and dataset; logs/report.json
        (preprocess's rejections and warnings) and the review page (review.py), out of the digest.
        Each generated caption is a record in the sample store (generate.py), keyed by the image's
        content, the captioner's digest, the prompt and the keyed settings (params.py): only
        records that do not exist yet are generated (+N images -> N captions, a renamed image -> none).
Key:    these params (the prompt resolved to the captioner's default) + the preprocess artifact's
        digest + the captioner's digest + every dataset's caption_policy and caption_text.
Digest: dataset.json and captions.json. A damaged record (unlike its recorded digest) is generated again.
A caption written by the user is never modified on disk (`lorapipe captions export` writes generated
ones as sidecars on request: export.py).
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lorapipe.cache.errors import UserError
from lorapipe.cache.fsutil import write_json_rows
from lorapipe.cache.object_store import open_sample_store
from lorapipe.cache.samples import DamagedRecord, SampleStore
from lorapipe.cache.store import LOG_DIR, Built

from ..contract import Log, OutputFile
from ..preprocess import DATASET_FILE, REPORT_FILE
from ..preprocess.sources import DatasetSource
from .captioners import default_prompt, model_type
from .generate import generate_records, read_caption
from .params import CaptionOptions, CaptionParams
from .policies import final_caption, needs_generated, written_caption
from .review import PAGE_FILES, REVIEW_MD, write_review

VERSION = "1"
# the review (out of the digest, under logs/), published into the run's outputs
OUTPUT_FILES: tuple[OutputFile, ...] = (OutputFile(f"{LOG_DIR}/{PAGE_FILES[0]}", "dataset review"),
                                        *(OutputFile(f"{LOG_DIR}/{page}") for page in PAGE_FILES[1:]),
                                        OutputFile(f"{LOG_DIR}/{REVIEW_MD}"))
CAPTIONS_FILE = "captions.json"

__all__ = ["VERSION", "OUTPUT_FILES", "CAPTIONS_FILE", "CaptionParams", "CaptionOptions", "CaptionInputs",
           "default_prompt", "policy_ingredients", "run"]


@dataclass(frozen=True)
class CaptionInputs:
    preprocess_dir: Path
    datasets: tuple[DatasetSource, ...]
    cache_root: Path
    model_path: Path  # the captioner's folder
    captioner: str  # its digest: its identity in record keys
    prompt: str  # resolved: the configured one or the captioner kind's default


def policy_ingredients(datasets: tuple[DatasetSource, ...]) -> dict:
    """Per dataset (by label) its caption policy and text: in the stage's key."""
    return {d.label: {"policy": d.caption_policy, "text": d.caption_text} for d in datasets}


def run(params: CaptionParams, inputs: CaptionInputs, out_dir: Path, work_dir: Path,
        options: CaptionOptions, log: Log = print) -> Built:
    samples = json.loads((inputs.preprocess_dir / DATASET_FILE).read_text())["samples"]
    keys = _record_keys(samples, params, inputs)
    store = open_sample_store(inputs.cache_root)
    generated, counts = _generated(samples, keys, params, inputs, store, options, log)
    entries = _caption_entries(samples, keys, generated, inputs.datasets)
    final = [{k: v for k, v in {**s, "caption": entries[s["id"]]["caption"]}.items() if k != "written"}
             for s in samples]
    write_json_rows(out_dir / DATASET_FILE, {"format": 2}, "samples", final)
    captions = {"captioner": {"model_type": model_type(inputs.model_path), "digest": inputs.captioner,
                              "prompt": inputs.prompt, "settings": params.model_dump(mode="json", exclude={"prompt"})},
                "samples": entries}
    (out_dir / CAPTIONS_FILE).write_text(json.dumps(captions, indent=1, sort_keys=True))
    report = json.loads((inputs.preprocess_dir / REPORT_FILE).read_text())
    (out_dir / LOG_DIR).mkdir()
    shutil.copyfile(inputs.preprocess_dir / REPORT_FILE, out_dir / LOG_DIR / REPORT_FILE)
    write_review(out_dir / LOG_DIR, final, captions, report, inputs.datasets)
    sources = dict(sorted(Counter(e["source"] for e in entries.values()).items()))
    log("caption: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f"; captions by source: {sources}")
    used = {store.index()[key].shard for key in keys.values()}
    return Built(info={**counts, "sources": sources}, refs=store.refs(used))


def _generated(samples: list[dict], keys: dict[str, str], params: CaptionParams, inputs: CaptionInputs,
               store: SampleStore, options: CaptionOptions, log: Log) -> tuple[dict[str, str], dict]:
    """(record key -> generated caption, counts), the missing records generated first. A damaged
    shard (a record unlike its recorded digest) is dropped and its captions generated again, once."""
    needed, made, shards, dropped = set(keys.values()), 0, 0, set()
    while True:
        missing = set(store.missing(needed))
        log(f"caption: {len(needed)} images take a generated caption, {len(missing)} to generate")
        todo = {keys[s["id"]]: s for s in samples if keys.get(s["id"]) in missing}
        if todo:
            shards += generate_records(todo, params, inputs.model_path, inputs.prompt, inputs.datasets, store,
                                       options, log)
        made += len(todo)
        try:
            captions = {key: read_caption(store, key) for key in sorted(needed)}
            return captions, {"generated": made, "reused": len(needed - set(todo)), "shards_written": shards}
        except DamagedRecord as damage:
            if damage.shard in dropped:
                raise
            dropped.add(damage.shard)
            store.remove(damage.shard)
            log(f"caption: {damage.path}: record {damage.key} {damage.problem}; dropping the shard and generating"
                " its captions again")


def _record_keys(samples: list[dict], params: CaptionParams, inputs: CaptionInputs) -> dict[str, str]:
    """Sample id -> its caption record's key, for the samples whose policy takes a generated caption."""
    keys = {}
    for s in samples:
        source = inputs.datasets[s["source"]]
        if not needs_generated(s, source):
            continue
        if "frames" in s:
            raise UserError(f"caption: {source.label}/{s['path']} is a clip: the caption stage captions images only;"
                            " give the clip a caption sidecar, or set caption_policy: fill_missing on its dataset")
        keys[s["id"]] = params.record_key(s["digest"], inputs.captioner, inputs.prompt)
    return keys


def _caption_entries(samples: list[dict], keys: dict[str, str], generated: dict[str, str],
                     datasets: tuple[DatasetSource, ...]) -> dict:
    """captions.json's samples: sample id -> final caption, source, written, generated, record, path, dataset."""
    entries = {}
    for s in samples:
        source, key = datasets[s["source"]], keys.get(s["id"])
        written = written_caption(s)
        caption, origin = final_caption(written, generated.get(key), source)
        entries[s["id"]] = {"caption": caption, "source": origin, "written": written, "generated": generated.get(key),
                            "record": key, "path": s["path"], "dataset": source.label}
    return entries
