"""Acting on the statistics: zero-block insertion and the direct residual intervention."""

# the tangent names itself to the protocol as the feature source of fs.Probe(cross=protocol)
from . import tangent as _tangent  # noqa: F401
