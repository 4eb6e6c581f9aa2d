"""The growth record's names follow later insertions.

References: the blocks and parameters each growth created, kept by identity at the time, found
again under the names the record gives after later growths, in both orders (the later block
before the earlier one, at the same point, and after it) and after
``save_pretrained``/``from_pretrained`` (the reloaded weights equal the blocks' own).
"""

from __future__ import annotations

import pytest
import torch
from test_grow_surgery import llama

import fused_stats as fs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def grow_at(model, point, seed):
    """Grow one block after ``point``; returns the block object and its parameters by name."""
    result = fs.grow(model, fs.GrowthProtocol([point], seed=seed), at=[point])
    position = result.positions[point]
    block = model.get_submodule(position)
    return block, {n: p for n, p in model.named_parameters() if n.startswith(position + ".")}


def check_entry(model, entry, block, params):
    """The entry names ``block`` and exactly its parameters, by identity."""
    assert model.get_submodule(entry["position"]) is block
    named = dict(model.named_parameters())
    by_id = {id(p) for p in params.values()}
    assert len(entry["new_parameters"]) == len(params)
    assert {id(named[n]) for n in entry["new_parameters"]} == by_id


@pytest.mark.parametrize(
    ("first", "second", "moved"),
    [
        ("model.layers.1", "model.layers.0", "model.layers.3"),  # the second block goes in before
        ("model.layers.1", "model.layers.1", "model.layers.3"),  # at the same point: also before
        ("model.layers.0", "model.layers.2", "model.layers.1"),  # after: the first keeps its name
    ],
)
def test_two_growths_keep_both_entries_naming_their_blocks(first, second, moved, tmp_path):
    model = llama(layers=3)
    block_a, params_a = grow_at(model, first, seed=1)
    with torch.no_grad():  # "trained": the two new blocks differ from any other block
        for p in params_a.values():
            p.add_(0.01 * torch.randn_like(p))
    block_b, params_b = grow_at(model, second, seed=2)
    history = fs.growth_history(model)
    assert [e["point"] for e in history] == [first, second]  # the names the protocols list
    assert history[0]["position"] == moved
    assert [e["block_id"] for e in history] == [0, 1]
    check_entry(model, history[0], block_a, params_a)
    check_entry(model, history[1], block_b, params_b)
    model.save_pretrained(tmp_path / "grown")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "grown", dtype=torch.float64)
    assert fs.growth_history(reloaded) == history
    for entry, block in zip(history, (block_a, block_b)):
        again = reloaded.get_submodule(entry["position"]).state_dict()
        assert again.keys() == block.state_dict().keys()
        assert all(torch.equal(v, again[k]) for k, v in block.state_dict().items())
    # a third growth on the reloaded model, before both: both move on, the ids stay
    fs.grow(reloaded, fs.GrowthProtocol(["model.embed_tokens"], seed=3))
    third = fs.growth_history(reloaded)
    assert [e["block_id"] for e in third] == [0, 1, 2]
    for old, new in zip(history, third):
        index = int(old["position"].rpartition(".")[2])
        assert new["position"] == f"model.layers.{index + 1}"
        assert new["new_parameters"] == [
            n.replace(old["position"] + ".", new["position"] + ".", 1) for n in old["new_parameters"]
        ]


def test_several_blocks_in_one_call_and_width_entries_are_renumbered():
    """Two blocks inserted by one call shift an earlier block by two; the widened parameters of a
    width growth move with their block; a saturation entry (no names) is left as it was."""
    from fused_stats.api.growth.record import record_saturation

    model = llama(layers=3)
    widths = fs.growth_points(model)[:-1]  # every boundary before a block: every MLP grows
    fs.grow(model, fs.GrowthProtocol(widths, family="mlp_width", width=2))
    widened = {
        e["position"]: [model.get_parameter(n) for n in e["widened"]] for e in fs.growth_history(model)
    }
    protocol = fs.GrowthProtocol(["model.layers.0"])
    record_saturation(model, protocol, 5, "none significant")
    block_c, params_c = grow_at(model, "model.layers.2", seed=4)  # new block at layers.3
    result = fs.grow(model, fs.GrowthProtocol(["model.embed_tokens", "model.layers.1"], seed=5))
    assert result.positions == {"model.embed_tokens": "model.layers.0", "model.layers.1": "model.layers.3"}
    history = fs.growth_history(model)
    assert [e["block_id"] for e in history if e["event"] == "grew"] == [0, 1, 2, 3, 4, 5]
    assert "block_id" not in history[3] and history[3]["position"] is None
    # old layers 0, 1, 2 are now 1, 2, 4; the block grown at layers.2 (index 3) is now 5
    assert [e["position"] for e in history[:3]] == ["model.layers.1", "model.layers.2", "model.layers.4"]
    for entry, before in zip(history[:3], widened.values()):
        assert [id(model.get_parameter(n)) for n in entry["widened"]] == [id(p) for p in before]
    assert history[4]["position"] == "model.layers.5"
    check_entry(model, history[4], block_c, params_c)
