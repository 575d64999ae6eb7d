"""What encode.caption_variants costs on disk: the size of one text record per family, measured on
the tiny models and scaled to the real ones.

Each family's tiny model encodes the eight demo captions in bfloat16 through its own text encoder
(the code path encode runs); the records are written as one shard of the sample store, so the
figure per record includes its safetensors header, its .json and the tar's 512-byte blocks. A
record's tensors are (tokens x width) hidden states (+ a pooled vector for SDXL and Flux.1), so at
full size a record is about tokens x width x 2 bytes in bf16 (x 4 in float32) plus that overhead;
`full_size_mib` applies this to the real models' text lengths and widths (FULL_SIZE below, from
their configs and pipelines). A training sample with K variants costs K records (identical variant
texts share one); held-out samples keep one.
"""
from __future__ import annotations

from pathlib import Path

from .common import tiny_model

DEMO_CAPTIONS = Path(__file__).resolve().parent.parent / "stages" / "assets" / "demo_images"
ARCHES = ("sd15", "sdxl", "flux1", "flux2-klein", "z-image", "qwen-image")
FULL_SIZE = {  # arch: (tokens of a record, hidden width, pooled width, what sets them)
    "sd15": (77, 768, 0, "CLIP ViT-L, 77-token window (SD2.x: 77 x 1024)"),
    "sdxl": (77, 2048, 1280, "CLIP-L 768 + bigG 1280 concatenated; bigG's pooled 1280"),
    "flux1": (512, 4096, 768, "T5-XXL padded to 512 tokens (schnell 256); CLIP-L pooled 768"),
    "flux2-klein": (512, 3 * 2560, 0, "Qwen3-4B layers 9, 18, 27 stacked, padded to 512 (9B: 3 x 4096)"),
    "z-image": (100, 2560, 0, "Qwen3-4B penultimate layer, unpadded: template + caption tokens (100 here)"),
    "qwen-image": (100, 3584, 0, "Qwen2.5-VL-7B last layer, unpadded, template dropped (100 tokens here)"),
}


def record_sizes(root: Path) -> list[dict]:
    import torch

    from lorapipe.cache.samples import SampleStore
    from lorapipe.stages import families
    from lorapipe.stages.encoded import encode_record

    captions = [p.read_text().strip() for p in sorted(DEMO_CAPTIONS.glob("*.txt"))]
    rows = []
    for arch in ARCHES:
        model = tiny_model(root, arch)
        family = families.for_model(model)
        settings = family.text_settings(model, families.TextOptions())
        records = family.text_encoder(model, settings, torch.bfloat16, "cpu")(captions)
        store = SampleStore(root / f"caption-records-{arch}")
        shard = store.write_shard({f"r{i}": encode_record(r, {"caption": c})
                                   for i, (r, c) in enumerate(zip(records, captions))})
        per_record = store.shard_path(shard).stat().st_size / len(records)
        tensor_bytes = sum(t.numel() * t.element_size() for r in records for t in r.values()) / len(records)
        tokens, width, pooled, source = FULL_SIZE[arch]
        full = tokens * width * 2 + pooled * 2 + (per_record - tensor_bytes)
        rows.append({"arch": arch, "tiny_shapes": {k: list(v.shape) for k, v in records[0].items()},
                     "tiny_bytes_per_record": round(per_record), "tiny_tensor_bytes": round(tensor_bytes),
                     "full_size": f"{tokens} x {width}" + (f" + {pooled}" if pooled else "") + f" bf16: {source}",
                     "full_size_mib": round(full / 2**20, 3)})
    return rows


if __name__ == "__main__":
    import json
    import sys

    for row in record_sizes(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-run").resolve()):
        print(json.dumps(row))
