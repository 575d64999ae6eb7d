"""Caption (issue 28): the stage's captions/s against the bare generate() loop, and what deciding
costs at 10,000 images with a caption stage.

`throughput`: for each captioner kind's tiny model (Qwen2.5-VL: stages/families/tiny/captioner.py;
Florence-2: tiny/florence.py), the caption stage (caption.run into an empty sample store: the
captioner loaded, images decoded, records keyed, generated, committed in shards, dataset.json,
captions.json and the review written) against the loop the models' documented usage runs (model
and processor loaded, then per batch the processor, generate() and decoding) on the same images in
the same batches (the stage's order: by record key) with the same settings; alternating rounds,
the fastest of each kept; the bare loop's captions must be the stage's.

`noop`: `lorapipe status`'s decision (keys and lookups of every stage, warm stat cache) on 10,000
unchanged images with a caption stage whose artifact is a hit, against the same decision without
a caption section (encode's no-op figure) in the same rounds; then what 50 new images cost: the
decision, preprocess, and the caption stage (50 generated, the rest reused); and the review's
pages and bytes at 10,000 images, against the same review on one page.

`camera_reads`: what the stage pays per camera photo besides generate(): its read of the image
and the review's thumbnail.
"""
from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Callable

from .common import generated_images, tiny_model
from .noop_rerun import decide, run_preprocess

KINDS = ("qwen2_5_vl", "florence2")
BUILDERS = {"qwen2_5_vl": ("lorapipe.stages.families.tiny.captioner", "build_tiny_captioner"),
            "florence2": ("lorapipe.stages.families.tiny.florence", "build_tiny_florence")}


def tiny_captioner(root: Path, kind: str) -> Path:
    from importlib import import_module

    folder = root / f"tiny-captioner-{kind}"
    if not (folder / "config.json").exists():
        module, builder = BUILDERS[kind]
        getattr(import_module(module), builder)(folder)
    return folder


def caption_inputs(data: Path, cache: Path, model: Path, params):
    """`data` preprocessed into `cache`/pre under caption_policy replace (every image takes a
    generated caption, written or not); the caption stage's inputs for it (`params` resolved)."""
    from lorapipe.cache.digest import StatCache, digest_tree
    from lorapipe.stages import caption, preprocess

    source = preprocess.DatasetSource(path=data, caption_policy="replace", missing_caption="empty")
    pre, sources = cache / "pre", (source,)
    shutil.rmtree(pre, ignore_errors=True)
    pre.mkdir(parents=True)
    with StatCache(cache / "stat.sqlite") as stats:
        preprocess.run(preprocess.PreprocessParams(resolution=64, holdout_fraction=0.0),
                       preprocess.PreprocessInputs(sources, stats), pre, cache, None, lambda m: None)
        identity = digest_tree(model, stats)
    return caption.CaptionInputs(pre, sources, cache, model, identity, params.prompt)


def stage_batches(inputs, params) -> list[list]:
    """The decoded images in the batches the stage makes: samples ordered by record key."""
    from lorapipe.stages.encode.images import upright_image
    from lorapipe.stages.preprocess.rows import read_rows

    samples = read_rows(inputs.preprocess_dir / "dataset.json")
    ordered = sorted(samples, key=lambda s: params.record_key(s.digest, inputs.captioner, inputs.prompt))
    images = [upright_image(inputs.datasets, s) for s in ordered]
    return [images[i:i + params.batch_size] for i in range(0, len(images), params.batch_size)]


def bare_qwen(model_path: Path, batches: list[list], prompt: str, generation: dict) -> list[str]:
    """Qwen2.5-VL's documented usage: the chat template, the processor, generate(), the new tokens decoded."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    captions = []
    for images in batches:
        batch = processor(text=[text] * len(images), images=images, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**batch, **generation)
        new = out[:, batch["input_ids"].shape[1]:]
        captions += [t.strip() for t in processor.batch_decode(new, skip_special_tokens=True)]
    return captions


def bare_florence(model_path: Path, batches: list[list], prompt: str, generation: dict) -> list[str]:
    """Florence-2's documented usage: the processor on the task token, generate(), each row decoded
    with its special tokens (less the padding batching adds) and post-processed for the task."""
    import torch
    from transformers import AutoProcessor, Florence2ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_path)
    model = Florence2ForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    captions = []
    for images in batches:
        batch = processor(text=[prompt] * len(images), images=images, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**batch, **generation)
        texts = processor.batch_decode(out, skip_special_tokens=False)
        captions += [processor.post_process_generation(text.replace(processor.tokenizer.pad_token, ""), task=prompt,
                                                       image_size=image.size)[prompt]
                     for text, image in zip(texts, images)]
    return captions


BARE: dict[str, Callable[[Path, list[list], str, dict], list[str]]] = {"qwen2_5_vl": bare_qwen,
                                                                     "florence2": bare_florence}


def run_caption(inputs, params, out: Path) -> dict:
    """The caption stage into an empty sample store; {record key: caption}."""
    import json

    from lorapipe.stages import caption

    shutil.rmtree(inputs.cache_root / "samples", ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    caption.run(params, inputs, out, out, caption.CaptionOptions(progress_every=0), lambda m: None)
    entries = json.loads((out / caption.CAPTIONS_FILE).read_text())["samples"].values()
    return {e["record"]: e["generated"] for e in entries}


def throughput(root: Path, n: int = 128, max_new_tokens: int = 64, batch_size: int = 8, rounds: int = 5,
               kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """Per kind: captions/s of the stage and the bare loop, the fastest of `rounds` alternating
    rounds after a warm-up round; `ratio` is stage / bare captions/s of the fastest (goal >= 0.9),
    `median_ratio` the median of each round's."""
    from lorapipe.stages.caption import CaptionParams
    from lorapipe.stages.processes.cpu_threads import threads_per_process, torch_threads

    data = generated_images(root / f"images-{n}", n)
    params = CaptionParams(max_new_tokens=max_new_tokens, batch_size=batch_size)
    with torch_threads(threads_per_process(None)):  # encode's count here: the cores less one
        return [kind_throughput(root, data, params, kind, rounds) for kind in kinds]


def kind_throughput(root: Path, data: Path, params, kind: str, rounds: int) -> dict:
    from lorapipe.stages.caption import resolved

    model = tiny_captioner(root, kind)
    params = resolved(params, model)  # the kind's prompt and beams, as the plan hands the stage
    inputs = caption_inputs(data, root / f"caption-throughput-{kind}", model, params)
    batches = stage_batches(inputs, params)
    n = sum(len(batch) for batch in batches)
    best, ratios, same = {"stage": float("inf"), "bare": float("inf")}, [], True
    for r in range(rounds + 1):  # round 0 warms up (first imports and calls)
        seconds = {}
        for name in (("stage", "bare") if r % 2 == 0 else ("bare", "stage")):
            started = time.perf_counter()
            if name == "stage":
                by_key = run_caption(inputs, params, inputs.cache_root / "out")
            else:
                bare = BARE[kind](model, batches, inputs.prompt, params.generation())
            seconds[name] = time.perf_counter() - started
        same = same and [by_key[k] for k in sorted(by_key)] == bare
        if r:
            best = {name: min(best[name], seconds[name]) for name in best}
            ratios.append(seconds["bare"] / seconds["stage"])
    return {"kind": kind, "images": n, "batch_size": params.batch_size, "max_new_tokens": params.max_new_tokens,
            "num_beams": params.num_beams,
            "rounds": rounds, "stage_captions_s": round(n / best["stage"], 1),
            "bare_captions_s": round(n / best["bare"], 1), "ratio": round(best["bare"] / best["stage"], 3),
            "ratio_per_round": [round(x, 3) for x in ratios], "median_ratio": round(statistics.median(ratios), 3),
            "same_captions": same}


def noop(root: Path, n: int = 10000, added: int = 50, rounds: int = 3) -> dict:
    """The no-op decision with a caption stage (its artifact a hit: every image captioned under
    caption_policy replace) against the same images without one, alternating, fastest of `rounds`;
    then `added` new images: the decision, and the preprocess and caption stages that follow."""
    from lorapipe.flows.config import validate_config

    data = generated_images(root / f"images-{n}", n)
    grown = root / f"images-caption-grow-{n}"
    shutil.rmtree(grown, ignore_errors=True)
    shutil.copytree(data, grown)
    cache = root / f"caption-noop-cache-{n}"
    shutil.rmtree(cache, ignore_errors=True)
    common = {"name": f"captionnoop{n}", "cache_dir": cache, "output_dir": root / "out",
              "model": {"path": tiny_model(root)}, "preprocess": {"resolution": 64},
              "train": {"max_steps": 1}, "evaluate": {"prompts": ["x"]}}
    plain = validate_config({**common, "data": {"path": grown}}, "benchmark")
    captioned = validate_config({**common, "data": {"datasets": [{"path": grown, "caption_policy": "replace"}]},
                                 "caption": {"model": tiny_captioner(root, "qwen2_5_vl"), "max_new_tokens": 2,
                                             "batch_size": 64}}, "benchmark")
    run_preprocess(plain)
    build = run_upto_caption(captioned)
    best = {"plain": float("inf"), "captioned": float("inf")}
    for _ in range(rounds):
        best = {"plain": min(best["plain"], decide(plain)), "captioned": min(best["captioned"], decide(captioned))}
    generated_images(grown, n + added)
    grow_decision = decide(captioned)
    grow = run_upto_caption(captioned)
    return {"images": n, "rounds": rounds, "decision_without_caption_s": round(best["plain"], 3),
            "decision_with_caption_s": round(best["captioned"], 3),
            "with_over_without": round(best["captioned"] / best["plain"], 3),
            "caption_first_build_s": round(build["caption"], 1), "images_added": added,
            "added_decision_s": round(grow_decision, 3), "added_preprocess_s": round(grow["preprocess"], 2),
            "added_caption_s": round(grow["caption"], 2), "added_generated": grow["generated"],
            "added_reused": grow["reused"], "review": review_sizes(build["artifact"], captioned.data.sources)}


def review_sizes(artifact: Path, datasets) -> dict:
    """The review's pages in the caption artifact `artifact`: their count and bytes (the largest
    page, all pages, the markdown), and the bytes and seconds of the same review on one page."""
    import json

    from lorapipe.stages.caption import CAPTIONS_FILE
    from lorapipe.stages.caption.review import PAGE_FILES, REVIEW_MD, Paging, write_review
    from lorapipe.stages.preprocess.rows import read_rows

    logs = artifact / "logs"
    pages = [logs / name for name in PAGE_FILES if (logs / name).exists()]
    samples = read_rows(artifact / "dataset.json")
    one_page = artifact.parent / f"{artifact.name}-one-page-review"
    shutil.rmtree(one_page, ignore_errors=True)
    one_page.mkdir()
    started = time.perf_counter()
    write_review(one_page, samples, json.loads((artifact / CAPTIONS_FILE).read_text()),
                 json.loads((logs / "report.json").read_text()), datasets, Paging(len(samples), 1))
    seconds = time.perf_counter() - started
    single = (one_page / PAGE_FILES[0]).stat().st_size
    shutil.rmtree(one_page)
    return {"pages": len(pages), "largest_page_bytes": max(p.stat().st_size for p in pages),
            "all_pages_bytes": sum(p.stat().st_size for p in pages), "md_bytes": (logs / REVIEW_MD).stat().st_size,
            "one_page_bytes": single, "one_page_write_s": round(seconds, 2)}


def run_upto_caption(config) -> dict:
    """Preprocess and caption run (or served) as a run does; each one's seconds and caption's counts."""
    from lorapipe.flows.steps import Context
    from lorapipe.flows.runner import run_stage

    ctx = Context(config, log=lambda m: None)
    seconds, upstream = {}, {}
    try:
        for stage in ("preprocess", "caption"):
            started = time.perf_counter()
            result, upstream[stage] = run_stage(ctx, stage, upstream)
            seconds[stage] = time.perf_counter() - started
    finally:
        ctx.close()
    return {**seconds, "generated": result.info.get("generated"), "reused": result.info.get("reused"),
            "artifact": Path(upstream["caption"].path)}


def camera_reads(root: Path) -> dict:
    """What the stage pays per image besides generate() on 12 MP camera JPEGs (decode_bench's),
    images/s on one thread: its read of each image (bytes, digest, a full decode, upright:
    generate.py, in the generate loop) and the review's thumbnail (a reduced decode)."""
    import json

    from lorapipe.stages.caption import CaptionParams
    from lorapipe.stages.caption.review import collect
    from lorapipe.stages.encode.images import upright_image
    from lorapipe.stages.preprocess.rows import read_rows

    from .decode_bench import camera_photos

    camera_photos(root / "photos-4000x3000")
    params = CaptionParams()
    inputs = caption_inputs(root / "photos-4000x3000", root / "caption-camera", tiny_captioner(root, "qwen2_5_vl"),
                            params)
    samples = read_rows(inputs.preprocess_dir / "dataset.json")
    started = time.perf_counter()
    for s in samples:
        upright_image(inputs.datasets, s)
    read = time.perf_counter() - started
    started = time.perf_counter()
    collect(samples, {}, {}, inputs.datasets)
    thumbnails = time.perf_counter() - started
    return {"photos": len(samples), "size": "4000x3000", "stage_read_img_s": round(len(samples) / read, 1),
            "review_thumbnail_img_s": round(len(samples) / thumbnails, 1)}


def main() -> None:
    """Print both benchmarks' figures (BENCHMARKS.md is left alone: `python -m benchmarks --only
    captioner_throughput --only captioner_noop` records them); --smoke: at tiny sizes, one round."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.captioner_bench", description=main.__doc__)
    parser.add_argument("--root", type=Path, default=Path("bench-run"))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    root = args.root.resolve()
    sizes = ({"n": 4, "max_new_tokens": 3, "batch_size": 2, "rounds": 1}, {"n": 6, "added": 2, "rounds": 1})
    for row in throughput(root, **sizes[0]) if args.smoke else throughput(root):
        print(json.dumps(row))
    print(json.dumps(noop(root, **sizes[1]) if args.smoke else noop(root)))


if __name__ == "__main__":
    main()
