"""Every preset loads; bad values are one-line errors naming the file and key."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lorapipe.flows.cli import main
from lorapipe.flows.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_preset_validates_and_starts_with_its_command(path):
    config = load_config(path)
    assert config.model.path.is_absolute() and config.evaluate.prompts
    assert "lorapipe" in path.read_text().splitlines()[1]


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    copy = tmp_path / "sub" / "demo.yaml"
    copy.write_text((CONFIGS[0].parent / "demo.yaml").read_text())
    config = load_config(copy, ["data.path=../images"])
    assert config.cache_dir == tmp_path / "sub" / "cache"
    assert config.data.path == tmp_path / "images"


@pytest.mark.parametrize("override, key", [
    ("train.learning_rate=-1", "train.learning_rate"),
    ("train.rnak=4", "train.rnak"),
    ("preprocess.resolution=65", "preprocess.resolution"),
    ("evaluate.prompts=[]", "evaluate.prompts"),
    ("encode.executor=ray", "encode.executor"),
    ("encode.dask_address=tcp://127.0.0.1:8786", "dask_address is set but executor is local"),
])
def test_a_bad_value_is_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS[0], [override])
    message = str(err.value)
    assert key in message and CONFIGS[0].name in message and "\n" not in message


def test_the_cli_reports_a_bad_config_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain: [1, 2\n")
    assert main(["status", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lorapipe: error:") and "bad.yaml" in err and "\n" not in err


def test_every_deployment_in_prefect_yaml_carries_a_valid_config():
    from lorapipe.flows.config import validate_config

    deployments = yaml.safe_load((CONFIGS[0].parent.parent / "prefect.yaml").read_text())["deployments"]
    assert deployments
    for deployment in deployments:
        config = validate_config(deployment["parameters"]["config"], f"prefect.yaml:{deployment['name']}")
        assert config.evaluate.prompts
