"""Sub-commands of ``fused-stats``; each module has ``register(subparsers)``.

Add a command by writing a module here and naming it in ``COMMANDS``.
"""

COMMANDS = (
    "synthetic",
    "merge",
    "plan",
    "demo",
    "probe",
    "report",
    "suite",
    "advise",
    "grow",
    "grow_demo",
)
