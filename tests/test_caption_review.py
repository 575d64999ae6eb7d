"""The dataset review (stages/caption/review.py): every image with its final caption and where it came
from, preprocess's rejections and warnings, bucket counts and caption lengths; the same bytes for
the same inputs; captions escaped; pages of at most a page's thumbnails, the images past the last
page listed without one; and, in a real Chromium, the thumbnails shown upright and a page's links."""
from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from lorapipe.cache.digest import StatCache
from lorapipe.stages.caption import OUTPUT_FILES
from lorapipe.stages.caption.review import (PAGE_FILES, REVIEW_HTML, REVIEW_MD, Paging, length_histogram,
                                            write_review)
from lorapipe.stages.preprocess import DATASET_FILE, REPORT_FILE, DatasetSource, PreprocessInputs, PreprocessParams, run
from lorapipe.stages.preprocess.rows import SampleRow, read_rows

RED, BLUE, TOP, BOTTOM = (220, 20, 20), (20, 40, 220), (20, 200, 40), (240, 220, 20)
EVIL = "<img src=x onerror=alert(1)> a | pipe & more &amp; \"quoted\""
ROTATED = 6  # EXIF orientation: the stored pixels turned 90° anticlockwise; a viewer turns them back


def upright_two_tone(path: Path) -> None:
    """A 60x120 (WxH) image, TOP colour above BOTTOM as the user sees it, stored sideways (120x60)
    with EXIF orientation 6 (a viewer turns it 90° clockwise)."""
    shown = Image.new("RGB", (60, 120), BOTTOM)
    shown.paste(TOP, (0, 0, 60, 60))
    exif = Image.Exif()
    exif[0x0112] = ROTATED
    shown.transpose(Image.Transpose.ROTATE_90).save(path, "JPEG", quality=95, exif=exif)


@pytest.fixture
def dataset(tmp_path) -> tuple[Path, tuple[DatasetSource, ...], list[dict], dict]:
    """A folder of images (one rotated, one with a hostile caption, one too small, one broken,
    two without a caption) through preprocess, and captions.json as the caption stage writes it."""
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (96, 64), RED).save(folder / "red.png")
    (folder / "red.txt").write_text("a red card")
    Image.new("RGB", (64, 96), BLUE).save(folder / "blue.png")
    upright_two_tone(folder / "turned.jpg")
    Image.new("RGB", (80, 80), RED).save(folder / "evil.png")
    (folder / "evil.txt").write_text(EVIL)
    Image.new("RGB", (16, 16), BLUE).save(folder / "small.png")
    (folder / "small.txt").write_text("a small blue square")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    (folder / "broken.txt").write_text("never shown")
    datasets = (DatasetSource(path=folder, missing_caption="empty"),)
    out = tmp_path / "pre"
    out.mkdir()
    with StatCache(tmp_path / "stat.sqlite") as cache:
        run(PreprocessParams(resolution=64, buckets=True, holdout_fraction=0.2,
                             bucket_sizes=((64, 64), (128, 64), (64, 128))), PreprocessInputs(datasets, cache),
            out, tmp_path, None, lambda line: None)
    samples = read_rows(out / DATASET_FILE)
    report = json.loads((out / REPORT_FILE).read_text())
    return tmp_path / "review", datasets, samples, {"captioner": {"model": "tiny-captioner", "prompt": "Describe."},
                                                    "samples": {s.id: stage_entry(s) for s in samples}}


def stage_entry(sample: SampleRow) -> dict:
    """captions.json's entry: red under policy prefix, the uncaptioned ones generated, the rest written."""
    entry = {"path": sample.path, "dataset": "data", "record": None, "written": sample.caption or None,
             "generated": None, "caption": sample.caption, "source": "written"}
    if sample.id == "red":
        return {**entry, "generated": "a shiny card", "caption": "sks, a shiny card", "source": "prefix", "record": "r1"}
    if not sample.caption:
        words = " ".join(["word"] * 12)
        return {**entry, "written": None, "generated": words, "caption": words, "source": "generated", "record": "r2"}
    return entry


SMALL_PAGES = Paging(page_size=2, max_pages=2)  # the five images: 2 + 2 thumbnails, the fifth a row


def written_review(dataset, paging: Paging = Paging(), folder: str = "") -> tuple[str, str]:
    out, datasets, samples, captions = dataset
    out = out / folder
    out.mkdir(parents=True, exist_ok=True)
    write_review(out, samples, captions, json.loads((dataset[0].parent / "pre" / REPORT_FILE).read_text()), datasets,
                 paging)
    return (out / REVIEW_HTML).read_text(), (out / REVIEW_MD).read_text()


def test_the_review_shows_each_image_caption_and_source_and_preprocess_findings(dataset):
    html, md = written_review(dataset)
    assert written_review(dataset) == (html, md)  # the same bytes for the same inputs
    samples = dataset[2]
    assert sorted(s.id for s in samples) == ["blue", "evil", "red", "small", "turned"]
    assert html.count('<img src="data:image/jpeg;base64,') == 5 and "data:" not in md
    assert EVIL not in html and "&lt;img src=x onerror=alert(1)&gt; a | pipe &amp; more &amp;amp; &quot;quoted&quot;" in html
    assert "\\<img src=x onerror=alert(1)\\> a \\| pipe & more \\&amp; \"quoted\"" in md and EVIL not in md
    assert "&quot;" not in md and "&lt;" not in md  # markdown, read as text too: its own escapes, not HTML's
    assert "sks, a shiny card" in html and "written: a red card" in html and "generated: a shiny card" in html
    for page in (html, md):
        assert "broken.png" in page and "small_image" in page and "small.png" in page  # rejected; warned
        assert "1 held out" in page and "5 images (4 train" in page
    sizes = sorted(f"{s.size[1]}x{s.size[0]}" for s in samples)
    for size in set(sizes):
        assert f"| {size} | {sizes.count(size)} |" in md
    assert "| generated | 2 |" in md and "| prefix | 1 |" in md and "| written | 2 |" in md
    assert "| 11-15 | 2 |" in md  # the two 12-word generated captions


def test_the_review_is_paged_and_bounded(dataset):
    first, md = written_review(dataset, SMALL_PAGES)
    second = (dataset[0] / "review-2.html").read_text()
    assert {p.name for p in dataset[0].iterdir()} == {REVIEW_HTML, "review-2.html", REVIEW_MD}
    ids = [s.id for s in dataset[2]]
    assert re.findall(r'<img [^>]*data-id="([^"]+)"', first) == ids[:2]
    assert re.findall(r'<img [^>]*data-id="([^"]+)"', second) == ids[2:4]  # the fifth: a row, no thumbnail
    last = next(s for s in dataset[2] if s.id == ids[4])
    assert "Images without thumbnails" in second and f"<td>{last.path}</td>" in second
    assert 'href="review-2.html"' in first and 'href="review.html"' in second and "Images 3-4 of 5" in second
    assert "Caption sources" in first and "Caption sources" not in second  # the summary tables: page 1 only
    assert md.count("| train |") + md.count("| holdout |") == 2 and "The first 2 of 5 images" in md
    assert len(PAGE_FILES) == Paging().max_pages  # every page a run may write is published
    assert [f.path for f in OUTPUT_FILES] == [f"logs/{name}" for name in (*PAGE_FILES, REVIEW_MD)]


def test_an_empty_caption_and_a_left_out_image_are_shown_for_what_they_are(dataset):
    """An image the caption stage could not read (source left_out, its caption empty): the sources
    table says what left_out counts, the card and the tables say the caption is empty, not "0 words"."""
    out, datasets, samples, captions = dataset
    blue = captions["samples"]["blue"]
    captions["samples"]["blue"] = {**blue, "generated": None, "caption": "", "source": "left_out", "record": None}
    html, md = written_review(dataset)
    assert "<td>left_out</td><td>1</td><td>not captioned: the image could not be read" in html
    assert "| left_out | 1 | not captioned: the image could not be read" in md
    assert '<figcaption><span class="empty">(empty caption)</span>' in html
    assert "| empty | 1 |" in md and "| 0 |" not in md and "| (empty caption) |" in md


def test_caption_lengths_are_counted_in_bins_with_none_left_out():
    assert length_histogram([0, 0, 3, 5, 6, 12]) == [("empty", 2), ("1-5", 2), ("6-10", 1), ("11-15", 1)]
    assert length_histogram([7]) == [("1-5", 0), ("6-10", 1)]
    assert length_histogram([]) == []


@pytest.mark.slow
def test_the_review_page_shows_its_thumbnails_upright_in_chromium(dataset, chromium, tmp_path):
    from browser import Chromium

    html, _ = written_review(dataset)
    page = dataset[0] / REVIEW_HTML
    browser = Chromium(chromium, tmp_path / "chromium-review")
    try:
        browser.call("Page.navigate", url=page.as_uri())
        boxes = browser.wait_for("""(() => { const images = [...document.querySelectorAll("img[data-id]")];
            if (!images.length || !images.every(i => i.complete && i.naturalWidth > 0)) return null;
            return {scale: window.devicePixelRatio, boxes: Object.fromEntries(images.map(i => {
                const b = i.getBoundingClientRect(); return [i.dataset.id, [b.x, b.y, b.width, b.height]]; }))}; })()""")
        shot = Image.open(io.BytesIO(browser.screenshot(tmp_path / "review.png").read_bytes())).convert("RGB")
    finally:
        browser.close()
    assert sorted(boxes["boxes"]) == ["blue", "evil", "red", "small", "turned"]

    def colour_at(image_id: str, fx: float, fy: float) -> tuple[int, ...]:
        x, y, w, h = boxes["boxes"][image_id]
        return shot.getpixel((round((x + fx * w) * boxes["scale"]), round((y + fy * h) * boxes["scale"])))

    x, y, w, h = boxes["boxes"]["turned"]
    assert h > w  # shown upright: taller than wide, as the user sees it (stored sideways)
    for image_id, fx, fy, expected in (("red", .5, .5, RED), ("blue", .5, .5, BLUE),
                                       ("turned", .5, .2, TOP), ("turned", .5, .8, BOTTOM)):
        seen = colour_at(image_id, fx, fy)
        assert max(abs(a - b) for a, b in zip(seen, expected)) < 24, (image_id, fy, seen, expected)


@pytest.mark.slow
def test_a_later_review_page_shows_its_thumbnails_and_links_back_in_chromium(dataset, chromium, tmp_path):
    from browser import Chromium

    written_review(dataset, SMALL_PAGES, "paged")
    browser = Chromium(chromium, tmp_path / "chromium-pages")
    try:
        browser.call("Page.navigate", url=(dataset[0] / "paged" / "review-2.html").as_uri())
        seen = browser.wait_for("""(() => { const images = [...document.querySelectorAll("img[data-id]")];
            if (!images.length || !images.every(i => i.complete && i.naturalWidth > 0)) return null;
            return {shown: images.length, rows: document.querySelectorAll("table tr").length - 1,
                    back: [...document.querySelectorAll("nav a")].map(a => a.href)}; })()""")
    finally:
        browser.close()
    assert seen["shown"] == 2 and seen["rows"] == 1  # two thumbnails, the fifth image a row
    assert seen["back"][0] == (dataset[0] / "paged" / REVIEW_HTML).as_uri()


@pytest.mark.slow
def test_long_captions_stay_inside_their_cards_in_chromium(dataset, chromium, tmp_path):
    """A long caption, and one long word (a path, a URL), wrap inside their card, which grows to hold
    them: no card's text runs over another card."""
    from browser import Chromium

    out, datasets, samples, captions = dataset
    captions["samples"]["red"]["caption"] = " ".join(["a very long caption"] * 40)
    captions["samples"]["blue"]["caption"] = "https://example.com/" + "x" * 300
    written_review(dataset, folder="long")
    browser = Chromium(chromium, tmp_path / "chromium-long")
    try:
        browser.call("Page.navigate", url=(out / "long" / REVIEW_HTML).as_uri())
        cards = browser.wait_for("""(() => { const figures = [...document.querySelectorAll("figure")];
            if (figures.length < 5 || document.readyState !== "complete") return null;
            const box = r => [r.left, r.top, r.right, r.bottom];
            return figures.map(f => { const text = document.createRange(); text.selectNodeContents(f);
                return {card: box(f.getBoundingClientRect()), text: box(text.getBoundingClientRect())}; }); })()""")
    finally:
        browser.close()
    for card in cards:
        left, top, right, bottom = card["card"]
        assert card["text"][0] >= left - 1 and card["text"][1] >= top - 1, card
        assert card["text"][2] <= right + 1 and card["text"][3] <= bottom + 1, card  # the card holds its text
    for i, a in enumerate(cards):
        for b in cards[i + 1:]:
            assert (a["card"][2] <= b["card"][0] or b["card"][2] <= a["card"][0] or a["card"][3] <= b["card"][1]
                    or b["card"][3] <= a["card"][1]), (a, b)  # no two cards overlap


def test_a_clip_window_is_shown_by_its_first_frame(tmp_path):
    from clips import scene, write_clip

    from lorapipe.stages.caption.review import collect

    folder = tmp_path / "clips"
    folder.mkdir()
    frames = scene(16)
    write_clip(folder / "walk.mp4", frames)
    (folder / "walk.txt").write_text("a square walks")
    datasets = (DatasetSource(path=folder),)
    with StatCache(tmp_path / "stat.sqlite") as cache:
        run(PreprocessParams(resolution=64, holdout_fraction=0, video={"fps": 8, "num_frames": 5}),
            PreprocessInputs(datasets, cache), tmp_path, tmp_path, None, lambda line: None)
    samples = read_rows(tmp_path / DATASET_FILE)
    (row,) = collect(samples, {"samples": {}}, {}, datasets).rows
    assert (row.source, row.caption, row.problem) == ("written", "a square walks", "")
    shown = Image.open(io.BytesIO(base64.b64decode(row.thumbnail.split(",", 1)[1]))).convert("RGB")
    first = Image.fromarray(frames[samples[0].frames[0]])
    assert shown.size == first.size
    assert max(abs(a - b) for a, b in zip(shown.getpixel((5, 12)), first.getpixel((5, 12)))) < 24
