"""Reports: ``schema`` (the version-1 format, its validation and strict-JSON encoding),
``document`` (the Report: JSON and markdown), ``sweeps`` (tables and trends over runs) and
``plots`` (the PNGs); the document re-exports the public names of the other three."""
