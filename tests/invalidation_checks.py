"""The cache invariants every family's encode keeps, checked the same way for each: on a copy of an
encoded baseline (the demo photos through a tiny model), through the real preprocess and encode
stages, with encodes counted by forward hooks on the VAE encoder and the text encoders
(conftest.count_encoder_rows), not by the stage's own counters. `text_rows`: the rows one caption
is to the text encoders (Flux.1: 2, CLIP's and T5's)."""
from __future__ import annotations

import shutil
from pathlib import Path

from conftest import copy_model
from test_invalidation import make_config, run_all, statuses

from lorapipe.flows.steps import STAGES, Context
from lorapipe.flows.runner import explain

IMAGES, CAPTIONS = 8, 8 + 1  # the demo photos; their captions and the empty prompt
TEXT_ROWS = {"hidream-i1": 6, "kandinsky5": 2, "kandinsky5-video": 2, "kandinsky5-i2v": 2}  # a tiny model's rows per caption where not 1:
# HiDream-I1's two CLIPs (each twice: transformers' CLIPTextModelWithProjection runs a CLIPTextModel inside), T5
# and Llama; Kandinsky 5's Qwen2.5-VL and CLIP
ENCODE = STAGES[:2]


def encoded_baseline(root: Path, model: Path, demo_images: Path, count_encoder_rows, text_rows: int = 1) -> Path:
    """The demo photos encoded by `model` (copied, with the data, into root), every encode counted."""
    copy_model(model, root / "model")
    shutil.copytree(demo_images, root / "data")
    with count_encoder_rows() as counts:
        results = run_all(make_config(root, root / "model", root / "data", root / "cache"), ENCODE)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": IMAGES, "text": text_rows * CAPTIONS}
    return root


def baseline_copy(baseline: Path, tmp_path: Path, **sections):
    copy_model(baseline / "model", tmp_path / "model")
    shutil.copytree(baseline / "data", tmp_path / "data")
    return make_config(tmp_path, tmp_path / "model", tmp_path / "data", baseline / "cache", **sections)


def encode_counted(config, count_encoder_rows) -> tuple[dict, dict]:
    with count_encoder_rows() as counts:
        results = run_all(config, ENCODE)
    return results, counts


def encode_row(config) -> dict:
    return next(r for r in explain(Context(config), STAGES) if r["stage"] == "encode")


def assert_every_text_record_and_no_latent_re_encoded(config, reason: str, count_encoder_rows,
                                                      text_rows: int = 1) -> None:
    """status names `reason` for the encode miss; the run re-encodes every caption and no image."""
    row = encode_row(config)
    assert row["status"] == "miss" and reason in row["reason"]
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "hit", "encode": "computed"}
    assert counts == {"vae": 0, "text": text_rows * CAPTIONS}
    assert results["encode"].info["latents_encoded"] == 0


def assert_caption_edit_encodes_one_text_record_and_no_latent(config, data: Path, count_encoder_rows,
                                                              text_rows: int = 1) -> None:
    (data / "coffee.txt").write_text("a photo of an espresso\n")
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "computed", "encode": "computed"}
    assert counts == {"vae": 0, "text": text_rows}
    assert results["encode"].info["texts_encoded"] == 1 and results["encode"].info["latents_encoded"] == 0


def assert_new_vae_weights_re_encode_latents_but_no_text(config, model: Path, count_encoder_rows) -> None:
    from safetensors.torch import load_file, save_file

    weights = model / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = {k: v * 1.01 if v.is_floating_point() else v for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    row = encode_row(config)
    assert row["status"] == "miss" and "models.vae" in row["reason"]
    results, counts = encode_counted(config, count_encoder_rows)
    assert statuses(results) == {"preprocess": "hit", "encode": "computed"}
    assert counts == {"vae": IMAGES, "text": 0}
    assert results["encode"].info["texts_encoded"] == 0
