"""Reports: ``schema`` (the version-1 format, its validation and strict-JSON encoding), ``data``
(a probe's results as that format's dict), ``document`` (the Report: JSON and markdown),
``sweeps`` (tables and trends over runs) and ``plots`` (the PNGs); the document re-exports the
public names of schema, sweeps and plots."""
