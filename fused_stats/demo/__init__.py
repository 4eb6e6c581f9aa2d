"""The ``fused-stats demo``: the width and depth papers' trend experiments in miniature.

Submodules: :mod:`.corpus` (stdlib source as bytes, split by file), :mod:`.models` (small
LLaMA-style decoders and single-pass training), :mod:`.experiment` (sweeps, probing, tables,
reports and plots), :mod:`.width_study` (the pre-registered width study), :mod:`.confirm` (the
grow-demo claims read from its JSON).
"""
