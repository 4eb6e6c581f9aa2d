"""The probe: the driver (Probe), its accumulator table, capture hooks, insertion points, feature axis, losses and the depth block spec."""
