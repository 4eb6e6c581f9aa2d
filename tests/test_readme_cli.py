"""The CLI page's example block (docs/cli.md), run top to bottom as bash, as a reader would paste it.

The folder holds what the page says it needs: a saved HF causal-LM folder ``my-llama`` (hidden
32, byte vocabulary, no tokenizer: ``--text`` is read as bytes), a config ``config.json`` (hidden
16), a text ``corpus.txt`` and 1-D tokens ``tokens.npy``. ``fused-stats`` is a shell function
running this checkout's CLI. Every command must exit 0 and the files it promises must exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fused_stats as fs

from tiny_models import TINY_LLAMA_CONFIG

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {**TINY_LLAMA_CONFIG, "max_position_embeddings": 128}  # the default --seq-len fits


def cli_block() -> str:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Examples, top to bottom\n") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_cli_block_runs_top_to_bottom(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    sizes = {k: v for k, v in CONFIG.items() if k != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**sizes, "hidden_size": 32}))
    model.save_pretrained(tmp_path / "my-llama")
    (tmp_path / "corpus.txt").write_bytes(rng.integers(32, 127, size=12_000).astype(np.uint8).tobytes())
    np.save(tmp_path / "tokens.npy", rng.integers(0, 256, size=100 * 128))
    script = (
        f'set -euo pipefail\nfused-stats() {{ "{sys.executable}" -m fused_stats.cli "$@"; }}\n' + cli_block()
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for out in ("probe_text", "probe_tokens", "probe_stdlib", "probe_cross"):
        report = fs.Report.from_json(tmp_path / out / "report.json")
        assert (tmp_path / out / "report.png").is_file() and report.points
    assert fs.Report.from_json(tmp_path / "probe_cross" / "report.json").points[0]["saturation"]
    assert (tmp_path / "sweep_width" / "sweep_width.png").is_file()
    assert (tmp_path / "sweep_depth" / "sweep_depth.png").is_file()
    assert (tmp_path / "sweep_probes" / "sweep_width.png").is_file()
    assert (tmp_path / "rendered" / "w64-d2-s0.md").is_file()
    sweep = proc.stdout[proc.stdout.rindex("== sweep over width ==") :]
    assert re.search(r"^\s+16\s+1\s", sweep, re.M) and re.search(r"^\s+32\s+1\s", sweep, re.M), sweep
