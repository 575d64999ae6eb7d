"""The parts of benchmarks/peer_step that are ours. The peer script itself (diffusers' example
train_text_to_image_lora.py) is not in the repo and CI has no network, so the comparison is run by
hand (BENCHMARKS.md); here: its data folder and the reading of its step seconds from tqdm's bar."""
import json

from tqdm import tqdm

from benchmarks.common import generated_images
from benchmarks.peer_step import peer_data, tqdm_step_seconds


def test_the_script_data_folder_pairs_every_image_with_its_caption(tmp_path):
    images = generated_images(tmp_path / "images", 2, 16)
    data = peer_data(images, tmp_path / "peer-data")
    rows = [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()]
    assert [row["file_name"] for row in rows] == ["img000000.png", "img000001.png"]
    assert all((data / row["file_name"]).is_file() for row in rows)
    assert rows[1]["text"] == (images / "img000001.txt").read_text()


def test_step_seconds_are_read_from_the_last_print_of_each_step_of_the_bar():
    bar = "\r".join(tqdm.format_meter(n, 3, elapsed, prefix="Steps", postfix=postfix) for n, elapsed, postfix in [
        (0, 0, None), (1, 97.4, None), (1, 98.9, "lr=0.0001, step_loss=0.1"), (2, 3700.2, "step_loss=0.2"),
        (3, 3801.0, "step_loss=0.3")])
    assert tqdm_step_seconds("loading\n" + bar + "\n") == [98.0, 3602.0, 101.0]
