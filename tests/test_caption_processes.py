"""The caption stage's job under `accelerate launch` (num_processes, CAPTION-DESIGN.md): two CPU
processes (MULTI_GPU + use_cpu, as encode's tests run them) write the same captions.json, byte for
byte, as one, greedy or sampled (each process takes whole batches of the sorted record keys, so a
batch, and the seed it is sampled with, does not depend on the process count); a rerun generates
nothing."""
from __future__ import annotations

import pytest
from test_caption import UPTO_CAPTION, caption_again, captions_of, half_captioned, raw_config
from test_invalidation import run_all

from lorapipe.flows.config import validate_config


@pytest.mark.slow
def test_two_processes_caption_as_one_does(tmp_path, tiny_model, tiny_captioner, demo_images, count_generated_rows):
    data = half_captioned(demo_images, tmp_path / "data")
    every_image = {"datasets": [{"path": str(data), "caption_policy": "replace"}]}  # 8 images: 4 batches of 2
    captions, lines = {}, []
    for sampling in ({}, {"do_sample": True, "seed": 3}):
        for processes in (1, 2):
            raw = raw_config(tmp_path, tiny_model, every_image, tmp_path / f"cache-{processes}-{len(sampling)}",
                             tiny_captioner, num_processes=processes, **sampling)
            results = run_all(validate_config(raw, "test"), UPTO_CAPTION, lines.append)
            assert results["caption"].info | {"sources": None} == {"generated": 8, "reused": 0, "left_out": 0,
                                                                   "sources": None}
            captions[processes, bool(sampling)] = (captions_of(results), raw)
        assert captions[2, bool(sampling)][0] == captions[1, bool(sampling)][0]
    assert lines.count("caption: 2 processes, 8 images") == 2
    assert any(line.startswith("[rank 1] caption: process 1 of 2: 4 images") for line in lines)
    greedy, sampled = ({i: e["generated"] for i, e in captions[1, s][0]["samples"].items()} for s in (False, True))
    assert greedy != sampled  # sampling took effect

    with count_generated_rows() as again:
        result = caption_again(validate_config(captions[2, True][1], "test"))
    assert again["rows"] == 0 and result.info["generated"] == 0 and result.info["reused"] == 8
