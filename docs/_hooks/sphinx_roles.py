"""A griffe extension for the API pages: the package's docstrings name other objects with Sphinx
roles (``:class:`~fused_stats.Probe```), which MkDocs would show as raw text. Each role becomes
the docs tool's cross-reference, ``[`Probe`][fused_stats.Probe]``, where its target is a name the
reference pages document (one of ``fused_stats.__all__``), and inline code elsewhere (private
modules and methods have no page to link to, and an unresolved link fails the strict build)."""

from __future__ import annotations

import re

import griffe

import fused_stats

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`<>]+?)`")
DOCUMENTED = set(fused_stats.__all__)


def _replace(match: re.Match) -> str:
    short, target = match.group(1), match.group(2).strip()
    shown = target.rsplit(".", 1)[-1] if short else target
    last = target.rsplit(".", 1)[-1]
    if target.startswith("fused_stats") and last in DOCUMENTED:
        return f"[`{shown}`][fused_stats.{last}]"
    return f"`{shown}`"


def convert(text: str) -> str:
    return ROLE.sub(_replace, text)


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
