"""Small residual networks for tests, examples and the demo (no torchvision needed).

Role: reproducible ResNets whose residual stream is explicit, so :func:`residual_points` and the
probe can be exercised on conv feature maps (B, C, H, W) without downloads.

* :func:`cifar_resnet20`: the CIFAR ResNet-20 of He et al. (2016, section 4.2): a 3x3 stem, three
  stages of ``n = 3`` basic blocks with ``width, 2 width, 4 width`` channels (16/32/64 in the paper),
  stride 2 at the start of stages 2 and 3 with a 1x1 projection shortcut, global average pooling and
  a linear classifier. Depth ``6n + 2 = 20``.
* :func:`tiny_resnet`: the torchvision ``ResNet`` layout (7x7 stride-2 stem, 3x3 max-pool,
  ``layer1..layer4`` with ``BasicBlock`` or ``Bottleneck`` blocks and ``downsample`` projections)
  at a configurable small width, so the torchvision naming (``layer2.0.downsample``) is covered.

Every block computes ``relu(F(x) + shortcut(x))``; the block's output is the residual stream. A
block built with ``out_relu=False`` computes ``F(x) + shortcut(x)``, no trailing ReLU: the form
growth inserts (:mod:`fused_stats.api.growth.blocks`), with an identity shortcut. With its branch
at zero that block is the identity for every input, and differentiable there, where
``relu(x + F(x))`` has a kink at every ``x = 0`` (a ReLU output has exact zeros). The flag is part
of the architecture, like the number of blocks: ``copy.deepcopy`` and pickling the module
(``torch.save(model)``) keep it, ``repr`` shows ``out_relu=False``; a ``state_dict`` holds tensors
only, so a model rebuilt to load one must be built with the same flags.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import FusedStatsError


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels)


def _check_flag(out_relu) -> bool:
    if not isinstance(out_relu, bool):
        raise FusedStatsError(f"out_relu must be True or False, got {out_relu!r}")
    return out_relu


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a skip: ``relu(bn2(conv2(relu(bn1(conv1 x)))) + downsample(x))``,
    without the outer ``relu`` when ``out_relu`` is False."""

    expansion = 1
    # modules pickled before the flag existed unpickle without it: they had the trailing ReLU
    out_relu = True

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        out_relu: bool = True,
    ):
        super().__init__()
        self.out_relu = _check_flag(out_relu)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = _bn(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = _bn(out_ch)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out)) + identity
        return self.relu(out) if self.out_relu else out

    def extra_repr(self) -> str:
        return "" if self.out_relu else "out_relu=False"  # default blocks print as before


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) and a skip, as in torchvision's ``Bottleneck``; the outer
    ``relu`` only when ``out_relu`` is True."""

    expansion = 4
    out_relu = True  # as in BasicBlock

    def __init__(
        self,
        in_ch: int,
        mid_ch: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        out_relu: bool = True,
    ):
        super().__init__()
        self.out_relu = _check_flag(out_relu)
        out_ch = mid_ch * self.expansion
        self.conv1 = nn.Conv2d(in_ch, mid_ch, 1, bias=False)
        self.bn1 = _bn(mid_ch)
        self.conv2 = nn.Conv2d(mid_ch, mid_ch, 3, stride, 1, bias=False)
        self.bn2 = _bn(mid_ch)
        self.conv3 = nn.Conv2d(mid_ch, out_ch, 1, bias=False)
        self.bn3 = _bn(out_ch)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out)) + identity
        return self.relu(out) if self.out_relu else out

    def extra_repr(self) -> str:
        return "" if self.out_relu else "out_relu=False"  # default blocks print as before


def _stage(block, in_ch: int, ch: int, blocks: int, stride: int) -> tuple[nn.Sequential, int]:
    out_ch = ch * block.expansion
    layers = []
    for i in range(blocks):
        s = stride if i == 0 else 1
        down = None
        if s != 1 or in_ch != out_ch:
            down = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, s, bias=False), _bn(out_ch))
        layers.append(block(in_ch, ch, s, down))
        in_ch = out_ch
    return nn.Sequential(*layers), in_ch


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 inputs: stem, three stages of ``n`` basic blocks, pool, linear."""

    def __init__(
        self, width: int = 16, blocks_per_stage: int = 3, num_classes: int = 10, in_channels: int = 3
    ):
        super().__init__()
        self.width = width
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = _bn(width)
        self.relu = nn.ReLU()
        ch = width
        self.layer1, ch = _stage(BasicBlock, ch, width, blocks_per_stage, 1)
        self.layer2, ch = _stage(BasicBlock, ch, 2 * width, blocks_per_stage, 2)
        self.layer3, ch = _stage(BasicBlock, ch, 4 * width, blocks_per_stage, 2)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean(dim=(2, 3)))


class ResNet(nn.Module):
    """torchvision-layout ResNet at a small base ``width`` (64 in torchvision)."""

    def __init__(
        self,
        block=BasicBlock,
        layers=(2, 2, 2, 2),
        width: int = 8,
        num_classes: int = 10,
        in_channels: int = 3,
    ):
        super().__init__()
        self.width = width
        self.conv1 = nn.Conv2d(in_channels, width, 7, 2, 3, bias=False)
        self.bn1 = _bn(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        ch = width
        self.layer1, ch = _stage(block, ch, width, layers[0], 1)
        self.layer2, ch = _stage(block, ch, 2 * width, layers[1], 2)
        self.layer3, ch = _stage(block, ch, 4 * width, layers[2], 2)
        self.layer4, ch = _stage(block, ch, 8 * width, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _randomise_bn(model: nn.Module, seed: int) -> None:
    # fresh BatchNorm has identity statistics; random ones make eval-mode BN a real affine map
    gen = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            c = mod.num_features
            mod.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
            mod.running_var.copy_(1.0 + 0.5 * torch.rand(c, generator=gen))
            with torch.no_grad():
                mod.weight.copy_(1.0 + 0.2 * torch.randn(c, generator=gen))
                mod.bias.copy_(0.1 * torch.randn(c, generator=gen))


def cifar_resnet20(
    width: int = 16, num_classes: int = 10, seed: int | None = None, random_batchnorm: bool = False
) -> CifarResNet:
    """CIFAR ResNet-20 (3 stages x 3 basic blocks, ``width/2w/4w`` channels; paper: 16/32/64).

    ``seed`` seeds the initialisation; ``random_batchnorm`` gives BatchNorm random running
    statistics and affine parameters (useful to test eval-mode behaviour without training).
    """
    if seed is not None:
        torch.manual_seed(seed)
    model = CifarResNet(width=width, blocks_per_stage=3, num_classes=num_classes)
    if random_batchnorm:
        _randomise_bn(model, 0 if seed is None else seed)
    return model


def tiny_resnet(
    block: str = "basic",
    layers=(1, 1, 1, 1),
    width: int = 8,
    num_classes: int = 10,
    seed: int | None = None,
    random_batchnorm: bool = False,
) -> ResNet:
    """torchvision-style ResNet (``block`` "basic" or "bottleneck") at base width ``width``."""
    kinds = {"basic": BasicBlock, "bottleneck": Bottleneck}
    if block not in kinds:
        raise FusedStatsError(f"block must be one of {sorted(kinds)}, got {block!r}")
    if seed is not None:
        torch.manual_seed(seed)
    model = ResNet(kinds[block], tuple(layers), width=width, num_classes=num_classes)
    if random_batchnorm:
        _randomise_bn(model, 0 if seed is None else seed)
    return model
