"""Reports: the version-1 report document, its markdown and plots, and sweeps over runs."""
