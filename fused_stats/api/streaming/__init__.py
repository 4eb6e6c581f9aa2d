"""Models larger than one device: weight-streamed blocks and the memory plan."""
