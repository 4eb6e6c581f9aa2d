"""Python API over models: probe driver, insertion points, reports (filled by later modules)."""
