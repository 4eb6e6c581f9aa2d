"""The measurement sections of ``bench/gpu_check.py``, one module per subject, and what they share.

Each section is ``section_NAME(run, ctx) -> dict``: ``run`` (:class:`.harness.Run`) takes its table
rows and per-case results, ``ctx`` (:class:`.harness.Ctx`) holds the problem sizes, the device and
the peers measured by earlier sections (the copy bandwidth, the matmul rates). The launcher
(``bench/gpu_check.py``) lists them, runs each in its own child process and writes the JSON.
"""
