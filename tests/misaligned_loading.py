"""State files read through deliberately misaligned tensors, whatever the CPU.

safetensors hands out tensors that are views into its file buffer, at whatever byte offset the
file's header left; BLAS kernels may round differently on operands that are not 64-byte aligned
(MKL's dgemm on AMD EPYC does). Whether a given machine shows it is luck, so these helpers force
the bad case everywhere: :class:`MisalignedLoading` patches safetensors' readers so that every
tensor they return lives ``OFFSET`` bytes past a 64-byte boundary, and records each view it made so
a test can check that the patch really took effect.

:func:`state_tensors` collects an accumulator's state tensors generically (every tensor reachable
from ``vars(acc)``, through dicts, lists and tuples), so the checks do not depend on how an
accumulator names or groups its fields.
"""

from __future__ import annotations

import math

import torch

ALIGNMENT = 64  # bytes: what the CPU allocator gives every fresh tensor
OFFSET = 8  # bytes past an ALIGNMENT boundary: a legal address for every dtype up to 8 bytes


def misaligned_copy(value: torch.Tensor, offset: int = OFFSET) -> torch.Tensor:
    """``value``'s bytes in a new tensor whose data starts ``offset`` bytes past a 64-byte boundary
    (a view into a larger uint8 buffer); empty tensors are returned unchanged."""
    value = value.detach().contiguous()
    if value.numel() == 0:
        return value
    nbytes = value.numel() * value.element_size()
    buffer = torch.empty(nbytes + 2 * ALIGNMENT, dtype=torch.uint8)
    start = (offset - buffer.data_ptr()) % ALIGNMENT
    raw = buffer[start : start + nbytes]
    raw.copy_(value.reshape(-1).view(torch.uint8))
    return raw.view(value.dtype).reshape(value.shape)


class MisalignedLoading:
    """Patches ``safetensors.safe_open`` (also as imported by ``safetensors.torch``) and
    ``safetensors.torch.load`` so every tensor read from a file is a misaligned view.

    ``offsets`` lists ``data_ptr() % 64`` of every view handed out."""

    def __init__(self, monkeypatch):
        import safetensors
        import safetensors.torch

        self.offsets: list[int] = []
        real_open, real_load = safetensors.safe_open, safetensors.torch.load
        loading = self

        class MisalignedHandle:
            def __init__(self, *args, **kwargs):
                self._handle = real_open(*args, **kwargs)

            def __enter__(self):
                self._handle.__enter__()
                return self

            def __exit__(self, *exc):
                return self._handle.__exit__(*exc)

            def get_tensor(self, key):
                return loading.view(self._handle.get_tensor(key))

            def get_tensors(self):
                return {key: self.get_tensor(key) for key in self._handle.keys()}  # noqa: SIM118  (a safetensors handle is not iterable)

            def __getattr__(self, name):
                return getattr(self._handle, name)

        monkeypatch.setattr(safetensors, "safe_open", MisalignedHandle)
        monkeypatch.setattr(safetensors.torch, "safe_open", MisalignedHandle)
        monkeypatch.setattr(
            safetensors.torch, "load", lambda data: {k: self.view(v) for k, v in real_load(data).items()}
        )

    def view(self, value: torch.Tensor) -> torch.Tensor:
        out = misaligned_copy(value)
        if out.numel():
            self.offsets.append(out.data_ptr() % ALIGNMENT)
        return out

    def check_used(self) -> None:
        """The patch produced misaligned views (else a test through it would prove nothing)."""
        assert self.offsets, "no tensor was read through the misaligned loader"
        assert all(o == OFFSET for o in self.offsets), self.offsets


# ----------------------------------------------------------------------------- state, generically
def _collect(prefix: str, value, tensors: dict, plain: dict) -> None:
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect(f"{prefix}.{key}", item, tensors, plain)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        for i, item in enumerate(value):
            _collect(f"{prefix}[{i}]", item, tensors, plain)
    elif value is None or isinstance(value, (bool, int, float, str, list, tuple)):
        plain[prefix] = value


def state_tensors(acc) -> dict[str, torch.Tensor]:
    """Every tensor an accumulator holds (reached from ``vars(acc)``), by attribute path."""
    tensors: dict = {}
    for key, value in vars(acc).items():
        _collect(key, value, tensors, {})
    return tensors


def plain_state(acc) -> dict:
    """The accumulator's non-tensor attributes of plain type (counts, mode, unit, ...)."""
    plain: dict = {}
    for key, value in vars(acc).items():
        _collect(key, value, {}, plain)
    return plain


def assert_aligned(acc, what: str = "") -> None:
    """Every non-empty state tensor starts on a 64-byte boundary."""
    tensors = state_tensors(acc)
    assert tensors, f"{what}: no state tensors found"
    bad = {k: v.data_ptr() % ALIGNMENT for k, v in tensors.items() if v.numel() and v.data_ptr() % ALIGNMENT}
    assert not bad, f"{what}: state tensors off a {ALIGNMENT}-byte boundary (offsets {bad})"


def _same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def assert_bit_identical(got, want, what: str = "") -> None:
    """Same tensors (names, dtypes, shapes, every bit) and the same plain attributes."""
    a, b = state_tensors(got), state_tensors(want)
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, (what, key)
        assert torch.equal(a[key], b[key]), f"{what}: state tensor {key!r} differs"
    pa, pb = plain_state(got), plain_state(want)
    for key in pa.keys() & pb.keys():
        assert _same_value(pa[key], pb[key]), (what, key, pa[key], pb[key])
