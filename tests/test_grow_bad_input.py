"""Growth refuses bad input: each rejected ``fs.grow`` call names what is wrong and leaves model,
config and optimizer as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from test_grow import F64, _train_steps, build

import fused_stats as fs


def _untouched(model, opt):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict() if hasattr(model, "config") else None
    params = [id(p) for p in model.parameters()]
    opt_state = copy.deepcopy(opt.state_dict()) if opt is not None else None
    opt_params = [id(p) for g in opt.param_groups for p in g["params"]] if opt is not None else None
    text = repr(model)

    def check():
        after = model.state_dict()
        assert list(after) == list(state)
        assert all(torch.equal(after[k], v) for k, v in state.items())
        assert [id(p) for p in model.parameters()] == params
        assert repr(model) == text
        if config is not None:
            assert model.config.to_dict() == config
        if opt is not None:
            assert [id(p) for g in opt.param_groups for p in g["params"]] == opt_params
            now = opt.state_dict()
            assert now["param_groups"] == opt_state["param_groups"]
            for k, s in opt_state["state"].items():
                assert all(torch.equal(now["state"][k][n], v) for n, v in s.items())

    return check


def _trained_llama(gen, **over):
    model = build("llama", F64)
    for k, v in over.items():
        # past the strict validator: a config that really lists one size per layer (as the NAS
        # variants of LLaMA do) is what is simulated
        object.__setattr__(model.config, k, v)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_steps(model, opt, gen, steps=1)
    return model, opt


def test_bad_input_names_it_and_changes_nothing(gen):
    cases = []
    model, opt = _trained_llama(gen)
    cases.append((model, opt, fs.GrowthProtocol(candidates=["model.layers.0.mlp"]), {}, "model.layers.0.mlp"))
    cases.append(
        (
            model,
            opt,
            fs.GrowthProtocol(candidates=["model.layers.0"]),
            {"at": ["model.layers.1"]},
            "not a candidate",
        )
    )
    cases.append(
        (
            model,
            opt,
            fs.GrowthProtocol(candidates=["model.layers.1"], family="mlp_width", width=2),
            {},
            "last block",
        )
    )
    cases.append(
        (
            model,
            opt,
            fs.GrowthProtocol(candidates=["model.layers.0"], family="mlp_width", width=2),
            {},
            r"model\.layers\.0'\] would keep",
        )
    )
    foreign = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.randn(3, 5, dtype=F64))], lr=0.1)
    cases.append((model, foreign, fs.GrowthProtocol(candidates=["model.layers.0"]), {}, r"shape \(3, 5\)"))
    tied, tied_opt = _trained_llama(gen)
    tied.model.layers[1].mlp.up_proj.weight = tied.model.layers[0].mlp.up_proj.weight
    cases.append((tied, tied_opt, fs.GrowthProtocol(candidates=["model.layers.0"]), {}, "tied"))
    cases.append(
        (
            tied,
            None,
            fs.GrowthProtocol(candidates=["model.embed_tokens"], family="mlp_width", width=2),
            {},
            "tied",
        )
    )
    per_layer, pl_opt = _trained_llama(gen, intermediate_size=[20, 20])
    cases.append(
        (
            per_layer,
            pl_opt,
            fs.GrowthProtocol(
                candidates=["model.embed_tokens", "model.layers.0"], family="mlp_width", width=2
            ),
            {},
            "per-layer",
        )
    )
    gpt2 = build("gpt2", F64)
    gpt2.config.scale_attn_by_inverse_layer_idx = True
    cases.append((gpt2, None, fs.GrowthProtocol(candidates=["transformer.h.0"]), {}, "scale_attn_by_inverse"))
    resnet = build("resnet20", F64)
    resnet_opt = torch.optim.SGD(resnet.parameters(), lr=0.1, momentum=0.9)
    cases.append(
        (
            resnet,
            resnet_opt,
            fs.GrowthProtocol(candidates=["layer1.0"], family="mlp_width", width=2),
            {},
            "not supported",
        )
    )
    cases.append(
        (
            resnet,
            resnet_opt,
            fs.GrowthProtocol(candidates=["layer1.2", "layer2.0"], init="copy"),
            {},
            "layer2.0",
        )
    )
    cases.append(
        (resnet, resnet_opt, fs.GrowthProtocol(candidates=["fc"]), {}, "'fc' is not a residual point")
    )
    cases.append((model, opt, fs.GrowthProtocol(candidates=["model.layers.0"]), {"init": "ones"}, "ones"))
    hooked = build("llama", F64)
    fs.insert_zero_block(hooked, "model.layers.1")
    cross = fs.GrowthProtocol(candidates=["model.layers.0", "model.layers.1"], family="cross_block")
    cases.append((hooked, None, cross, {}, r"\['model.layers.1'\] already have"))
    cases.append(
        (model, opt, fs.GrowthProtocol(candidates=["model.layers.0"], family="mlp_width", width=2), {"init": "random"},
         "needs family 'layer'")
    )  # fmt: skip
    for m, o, protocol, kw, message in cases:
        check = _untouched(m, o)
        with pytest.raises(fs.FusedStatsError, match=message):
            fs.grow(m, protocol, optimizer=o, **kw)
        check()
