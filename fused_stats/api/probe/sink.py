"""The gradient sink of one step: which gradients reaching a point's tensor hook count.

Role: :class:`GradientSink` is shared by :meth:`fused_stats.Probe.step` (its in-backward fold,
:class:`fused_stats.api.probe.fold.StepFold`) and :meth:`fused_stats.Probe.observe`
(:mod:`fused_stats.api.training.observe`). A tensor hook on a point's output fires for every
backward pass that runs through it, not only the one whose gradient the statistics need; the sink
says which arrivals count and refuses a step whose arrivals do not give one gradient per point:

* **Own backward only** (``Probe.step``): the sink accepts gradients only inside
  :meth:`own_backward`, i.e. during the step's one ``torch.autograd.grad`` of ``Σ_b ℓ_b``, and only
  from that graph task (``torch._C._current_graph_task_id``, read by a hook on the summed loss,
  which fires first). A ``torch.autograd.grad`` the loss function calls itself (a gradient
  penalty, a saliency term) runs before it and is not an arrival: the step's gradients are the
  total derivatives of the losses, penalty included, as the staged fold takes them.
* **The user's backward** (``observe``): the sink cannot tell the training step's backward from a
  ``torch.autograd.grad`` inside the loss, so every arrival counts and a second one at a point
  (such a nested call, a module reused in one forward, or two backward passes in one block) is
  refused.
* **Exactly one arrival per point.** Two arrivals: refused (:meth:`check`). No arrival at a point
  whose output was part of the loss's graph: refused (a pruned backward, ``inputs=``); with no path
  from the loss to the point (autograd proves it: the point is not reachable from the loss's
  ``grad_fn``), its gradient is exactly zero and is folded as zero.
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import FusedStatsError


def graph_task_id() -> int:
    """The id of the autograd graph task running now (-1 outside a backward)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else int(current())


def gradient_node(tensor: torch.Tensor):
    """The autograd node a gradient with respect to ``tensor`` enters (its ``grad_fn``, or the
    ``AccumulateGrad`` of a leaf); None for a tensor that does not require grad."""
    if not tensor.requires_grad:
        return None
    return tensor.grad_fn or torch.autograd.graph.get_gradient_edge(tensor).node


def reachable(root, targets, first_only: bool = False) -> set[int]:
    """The ids of the nodes ``targets`` (nodes, or a set of node ids) that a backward from the
    node ``root`` runs through:
    a breadth-first walk over ``next_functions`` (the nodes stay navigable after their saved
    tensors are freed) that stops once all are found, or the first with ``first_only`` (a
    residual block's output finds the block's input among the children of its sum)."""
    wanted = targets if isinstance(targets, set) else {id(t) for t in targets if t is not None}
    found: set[int] = set()
    if root is None or not wanted:
        return found
    if id(root) in wanted:
        found.add(id(root))
    seen = {id(root)}
    frontier = [root]
    while frontier and len(found) < len(wanted) and not (first_only and found):
        children = []
        for node in frontier:
            for child, _ in node.next_functions:
                if child is None or id(child) in seen:
                    continue
                seen.add(id(child))
                if id(child) in wanted:
                    found.add(id(child))
                children.append(child)
        frontier = children
    return found


class GradientSink:
    """Arrival bookkeeping of one step (module docstring).

    ``own_backward=True``: arrivals count only inside :meth:`own_backward`; False: whenever a
    point's hook fires (``observe``). :meth:`accept` is called by the hooks, :meth:`check` after
    the backward, before anything is committed.
    """

    def __init__(self, points, own_backward: bool, where: str = "Probe.step"):
        self.points = list(points)
        self.own_backward = own_backward
        self.where = where
        self.arrivals = dict.fromkeys(self.points, 0)
        self.nodes: dict[str, object] = {}  # point -> the node its gradient enters
        self._task: int | None = None  # the own backward's graph task, once it has started

    def watch(self, name: str, tensor: torch.Tensor) -> None:
        """Record the node of ``name``'s hooked output (for the reachability check)."""
        node = gradient_node(tensor)
        if node is not None:
            self.nodes.setdefault(name, node)

    @contextlib.contextmanager
    def own_backward_of(self, total: torch.Tensor):
        """Accept arrivals during the backward of ``total`` run inside this block only: from
        the moment the hook on ``total`` fires (the first node of that backward), in its graph task."""
        self._task = None
        total.register_hook(self._started)
        yield

    def _started(self, grad) -> None:
        self._task = graph_task_id()

    def accept(self, name: str) -> bool:
        """Whether a gradient reaching ``name``'s hook now is the step's (counts it); a second
        one is counted too, and refused by :meth:`check`."""
        if self.own_backward and graph_task_id() != self._task:
            return False  # before the step's backward (no task yet), or one run inside it
        self.arrivals[name] += 1
        return self.arrivals[name] == 1

    def check(self, root=None, ran: list[str] | None = None) -> list[str]:
        """Raise for a point with more than one arrival, or with none although the loss's graph
        (from the node ``root``, when given) runs through its output; return the points without
        an arrival whose gradient is exactly zero. ``ran``: the points whose output was hooked
        (default all)."""
        twice = {n: k for n, k in self.arrivals.items() if k > 1}
        if twice:
            hint = "" if self.own_backward else "; use one observe block per forward/backward pair"
            raise FusedStatsError(
                f"{self.where}: points received more than one gradient in one step {twice} (a "
                "torch.autograd.grad inside the loss, a module reused in one forward, or several "
                f"backward passes){hint}; nothing was accumulated"
            )
        ran = self.points if ran is None else ran
        missing = [n for n in ran if not self.arrivals[n]]
        if not missing:
            return []
        if root is None:
            in_graph = [n for n in missing if n in self.nodes]
        else:
            hit = reachable(root, [self.nodes.get(n) for n in missing])
            in_graph = [n for n in missing if id(self.nodes.get(n)) in hit]
        if in_graph:
            raise FusedStatsError(
                f"{self.where}: points {in_graph} are part of the loss's autograd graph but no "
                "gradient reached them during the backward (a backward with inputs= that "
                "excludes them, or a hook that stopped it); nothing was accumulated"
            )
        return missing
