"""A suite's [growth] section takes every key a protocol file takes: the set is the protocol file's
own (one list of growth keys), and each value reaches the suite's GrowthProtocol."""

from __future__ import annotations

import pytest

import fused_stats as fs
from fused_stats.api.growth.protocol_file import KEYS as PROTOCOL_KEYS
from fused_stats.api.suite.spec import SECTIONS, protocol_for, read_suite

SUITE = """
[data]
train = "train.txt"
test = "test.txt"
seq_len = 8
sequences = 8
batch_size = 4
[probe]
unit = "sample"
[growth]
candidates = ["model.layers.0", "model.layers.1"]
family = "layer"
seed = 7
adam_eps = 1e-6
train_batch_size = 4
[[runs]]
model = "ckpt"
"""


def _suite(tmp_path, text):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(
        '{"hidden_size": 16, "num_hidden_layers": 2, "model_type": "llama"}'
    )
    (tmp_path / "train.txt").write_text("train text " * 20)
    (tmp_path / "test.txt").write_text("test text " * 20)
    path = tmp_path / "suite.toml"
    path.write_text(text)
    return path


def test_growth_section_keys_are_the_protocol_files_plus_alpha():
    assert set(PROTOCOL_KEYS) | {"alpha"} == SECTIONS["growth"]
    assert "train_batch_size" in SECTIONS["growth"]


def test_train_batch_size_and_adam_eps_reach_the_protocol(tmp_path):
    spec = read_suite(_suite(tmp_path, SUITE))
    protocol = protocol_for(spec.growth, ["model.layers.0", "model.layers.1"])
    assert protocol.train_batch_size == 4 and protocol.adam_eps == 1e-6 and protocol.seed == 7
    # the same keys written as a plain protocol give the same digest
    direct = fs.GrowthProtocol(
        ("model.layers.0", "model.layers.1"), family="layer", seed=7, adam_eps=1e-6, train_batch_size=4
    )
    assert protocol.digest == direct.digest


@pytest.mark.parametrize("bad", ["0", "-2", '"4"', "2.5"])
def test_bad_train_batch_size_refused_naming_the_key(tmp_path, bad):
    path = _suite(tmp_path, SUITE.replace("train_batch_size = 4", f"train_batch_size = {bad}"))
    with pytest.raises(fs.FusedStatsError, match="train_batch_size"):
        read_suite(path)
