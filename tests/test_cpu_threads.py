"""One rule sets torch's CPU threads in every stage (stages/processes/cpu_threads.py): the stage's
cpu_threads, else the config's, else OMP_NUM_THREADS, else the cores this process may use less
one, shared among the stage's processes. Never the machine's load: torch's CPU results depend on
the count. (Where the count reaches the processes: test_evaluate.py, test_encode_dask.py, test_train.py.)"""
from __future__ import annotations

import os

import pytest

from lorapipe.cache.errors import UserError
from lorapipe.flows.config import split, validate_config
from lorapipe.stages.processes.cpu_threads import threads_per_process
from lorapipe.stages.encode import EncodeOptions, EncodeParams
from lorapipe.stages.evaluate import EvalOptions, EvalParams
from lorapipe.stages.processes.placement import place
from lorapipe.stages.train import TrainOptions, TrainParams, where

CONFIG = {"cache_dir": "cache", "output_dir": "out", "model": {"path": "model"}, "data": {"path": "data"},
          "train": {}, "evaluate": {"prompts": ["a photo of a cat"]}}


def test_the_setting_wins_then_omp_num_threads_then_the_cores_less_one(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))  # taskset, a container's cpuset
    assert threads_per_process(None) == 8 and threads_per_process(None, processes=2) == 4
    assert threads_per_process(None, processes=16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_process(None) == threads_per_process(None, processes=2) == 3  # per process, as OpenMP reads it
    assert threads_per_process(5) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # nested parallelism's levels: the outer one
    assert threads_per_process(None) == 4


@pytest.mark.parametrize("value", ["many", "0", "-2"])
def test_an_omp_num_threads_that_is_no_number_of_threads_is_named(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(UserError, match=f"OMP_NUM_THREADS='{value}' in the environment is not a number of threads"):
        threads_per_process(None)
    assert threads_per_process(2) == 2  # the config's setting does not read it


def test_the_configs_cpu_threads_reaches_every_stage_unless_the_stage_sets_its_own():
    config = validate_config({**CONFIG, "cpu_threads": 3, "train": {"cpu_threads": 1}}, "config.yaml")
    assert split(config.encode, EncodeParams, EncodeOptions)[1].cpu_threads == 3
    assert split(config.evaluate, EvalParams, EvalOptions)[1].cpu_threads == 3
    params, options = split(config.train, TrainParams, TrainOptions)
    assert place(where(params, options)).threads(options.cpu_threads) == 1
    plain = validate_config(CONFIG, "config.yaml")
    for name, params in (("encode", EncodeParams), ("train", TrainParams), ("evaluate", EvalParams)):
        keyed = split(getattr(config, name), params, None)[0]
        assert keyed == split(getattr(plain, name), params, None)[0], name  # not keyed: the same cache keys
    assert validate_config(config.model_dump(mode="json"), "again") == config  # a deployment's parameter round trip
