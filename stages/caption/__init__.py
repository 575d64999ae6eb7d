"""Caption (optional, configured by a `caption:` section): generated captions for the images whose
dataset's caption_policy asks for one, between preprocess and encode.

Reads:  the preprocess artifact (dataset.json, report.json), the images it names (whole and upright,
        as the user sees them), the captioner (a local transformers folder: captioners.py).
Writes: dataset.json: preprocess's format and samples, each caption final (encode reads it as it
        reads preprocess's); captions.json: the captioner (kind, digest, prompt, settings) and per
        sample its final caption, where it came from (written, generated, replace, prefix, suffix,
        combine, left_out), the written and generated captions, the record key, path and dataset;
        logs/report.json (preprocess's rejections and warnings, and a warning row per image left out)
        and the review page (review.py), out of the digest.
        Each generated caption is a record in the sample store (generate.py), keyed by the image's
        content, the captioner's digest, the prompt and the keyed settings (params.py): only
        records that do not exist yet are generated (+N images -> N captions, a renamed image -> none),
        where the stage's placement says (workers.py: this process, or num_processes under
        `accelerate launch`).
An image that cannot be decoded (or changed since preprocess) is left out of captioning, keeping its
written caption or none: encode, which reports such images in its own report.json and trains
without them for every config, captioned or not, does so for it too.
Key:    these params (the prompt and num_beams resolved to the captioner kind's defaults) + the preprocess artifact's
        digest + the captioner's digest + every dataset's caption_policy and caption_text.
Digest: dataset.json and captions.json. A damaged record (unlike its recorded digest) is generated again.
A caption written by the user is never modified on disk (`lorapipe captions export` writes generated
ones as sidecars on request: export.py).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lorapipe.cache.errors import UserError
from lorapipe.cache.object_store import open_sample_store
from lorapipe.cache.samples import DamagedRecord
from lorapipe.cache.store import LOG_DIR, Built

from ..contract import Log, OutputFile
from ..processes.placement import Placement, Where, place
from ..preprocess import DATASET_FILE, REPORT_FILE
from ..preprocess.rows import SampleRow, read_rows, write_rows
from ..preprocess.sources import DatasetSource
from .captioners import model_type, resolved
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
FINDINGS_FILE = f"{LOG_DIR}/{REPORT_FILE}"  # preprocess's rows and the images left out, for the run's report.md
LEFT_OUT = "left_out"  # the source of an image that could not be read: not captioned

__all__ = ["VERSION", "OUTPUT_FILES", "CAPTIONS_FILE", "CaptionParams", "CaptionOptions", "CaptionInputs",
           "policy_ingredients", "resolved", "run", "where"]


@dataclass(frozen=True)
class CaptionInputs:
    preprocess_dir: Path
    datasets: tuple[DatasetSource, ...]
    cache_root: Path
    model_path: Path  # the captioner's folder
    captioner: str  # its digest: its identity in record keys
    prompt: str  # resolved: the configured one or the captioner kind's default (captioners.resolved)

    def to_json(self) -> dict:
        return {"preprocess_dir": str(self.preprocess_dir), "datasets": [d.model_dump(mode="json") for d in self.datasets],
                "cache_root": str(self.cache_root), "model_path": str(self.model_path), "captioner": self.captioner,
                "prompt": self.prompt}

    @classmethod
    def from_json(cls, v: dict) -> CaptionInputs:
        return cls(Path(v["preprocess_dir"]), tuple(DatasetSource(**d) for d in v["datasets"]), Path(v["cache_root"]),
                   Path(v["model_path"]), v["captioner"], v["prompt"])


def policy_ingredients(datasets: tuple[DatasetSource, ...]) -> dict:
    """Per dataset (by label) its caption policy and text: in the stage's key."""
    return {d.label: {"policy": d.caption_policy, "text": d.caption_text} for d in datasets}


def where(params: CaptionParams, options: CaptionOptions) -> Where:
    """Where caption's job runs (stages/processes/placement.py): num_processes under accelerate when more
    than one batch of images is missing, else one process."""
    return Where(options.num_processes, one_process_up_to=params.batch_size)


def run(params: CaptionParams, inputs: CaptionInputs, out_dir: Path, work_dir: Path,
        options: CaptionOptions, log: Log = print, placement: Placement | None = None) -> Built:
    """`placement`: where the missing records are generated (the plan's; default: what `where` says)."""
    samples = read_rows(inputs.preprocess_dir / DATASET_FILE)
    keys = _record_keys(samples, params, inputs)
    generated, left_out, counts = _generated(samples, keys, params, inputs, options,
                                             placement or place(where(params, options)), work_dir, log)
    entries = _caption_entries(samples, keys, generated, left_out, inputs.datasets)
    final = [s.model_copy(update={"caption": entries[s.id]["caption"], "written": None}) for s in samples]
    write_rows(out_dir / DATASET_FILE, final)
    captions = {"captioner": {"model_type": model_type(inputs.model_path), "digest": inputs.captioner,
                              "prompt": inputs.prompt, "settings": params.model_dump(mode="json", exclude={"prompt"})},
                "samples": entries}
    (out_dir / CAPTIONS_FILE).write_text(json.dumps(captions, indent=1, sort_keys=True))
    report = json.loads((inputs.preprocess_dir / REPORT_FILE).read_text())
    report = {**report, "warnings": report["warnings"] + sorted(left_out.values(), key=lambda row: row["path"])}
    (out_dir / LOG_DIR).mkdir()
    (out_dir / LOG_DIR / REPORT_FILE).write_text(json.dumps(report, indent=1, sort_keys=True))
    write_review(out_dir / LOG_DIR, final, captions, report, inputs.datasets)
    sources = dict(sorted(Counter(e["source"] for e in entries.values()).items()))
    log("caption: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f"; captions by source: {sources}")
    store = open_sample_store(inputs.cache_root)  # with the records the job wrote
    used = {store.index()[key].shard for key in generated}
    return Built(info={**counts, "sources": sources}, refs=store.refs(used))


def _generated(samples: list[SampleRow], keys: dict[str, str], params: CaptionParams, inputs: CaptionInputs,
               options: CaptionOptions, placement: Placement, work_dir: Path,
               log: Log) -> tuple[dict[str, str], dict[str, dict], dict]:
    """(record key -> generated caption, record key -> the report row of an image left out, counts),
    the missing records generated first where `placement` says. A damaged shard (a record unlike its
    recorded digest) is dropped and its captions generated again, once."""
    from .workers import generate_at

    needed, made, dropped, left_out = set(keys.values()), 0, set(), {}
    store = open_sample_store(inputs.cache_root)
    while True:
        missing = set(store.missing(needed))
        log(f"caption: {len(needed)} images take a generated caption, {len(missing)} to generate")
        todo = {keys[s.id]: s.to_json() for s in samples if keys.get(s.id) in missing}  # as the job carries them
        if todo:
            left_out = generate_at(placement.sized(len(todo)), todo, params, inputs, options, work_dir, log)
            store = open_sample_store(inputs.cache_root)  # a fresh index: the job wrote with stores of its own
            made += len(todo) - len(left_out)
        try:
            captions = {key: read_caption(store, key) for key in sorted(needed - set(left_out))}
            return captions, left_out, {"generated": made, "reused": len(needed - set(todo)),
                                        "left_out": len(left_out)}
        except DamagedRecord as damage:
            if damage.shard in dropped:
                raise
            dropped.add(damage.shard)
            store.remove(damage.shard)
            log(f"caption: {damage.path}: record {damage.key} {damage.problem}; dropping the shard and generating"
                " its captions again")


def _record_keys(samples: list[SampleRow], params: CaptionParams, inputs: CaptionInputs) -> dict[str, str]:
    """Sample id -> its caption record's key, for the samples whose policy takes a generated caption."""
    keys = {}
    for s in samples:
        source = inputs.datasets[s.source]
        if not needs_generated(s, source):
            continue
        if s.is_clip:
            raise UserError(f"caption: {source.label}/{s.path} is a clip: the caption stage captions images only;"
                            " give the clip a caption sidecar, or set caption_policy: fill_missing on its dataset")
        keys[s.id] = params.record_key(s.digest, inputs.captioner, inputs.prompt)
    return keys


def _caption_entries(samples: list[SampleRow], keys: dict[str, str], generated: dict[str, str],
                     left_out: dict[str, dict], datasets: tuple[DatasetSource, ...]) -> dict:
    """captions.json's samples: sample id -> final caption, source, written, generated, record, path, dataset.
    An image left out keeps its written caption, or none: encode, which cannot read it either, leaves it out."""
    entries = {}
    for s in samples:
        source, key = datasets[s.source], keys.get(s.id)
        written = written_caption(s)
        caption, origin = ((written or "", LEFT_OUT) if key in left_out
                           else final_caption(written, generated.get(key), source))
        entries[s.id] = {"caption": caption, "source": origin, "written": written, "generated": generated.get(key),
                         "record": key, "path": s.path, "dataset": source.label}
    return entries
