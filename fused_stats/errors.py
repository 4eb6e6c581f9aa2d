"""The one exception type of the package.

Every rejected input raises :class:`FusedStatsError` with a message that names what was seen
(shape, dtype, device, point) and what was expected, so a user can fix the call without reading
the source. A rejected batch never changes an accumulator's state.
"""


class FusedStatsError(ValueError):
    """Bad input, incompatible states, too few samples or a damaged state file."""
