"""Small reference networks (CIFAR ResNets) used by the examples, the demo and the tests; no dependency on the probe."""
