"""Models larger than one device: weight-streamed blocks and the memory plan.

``builders`` (:func:`stream_blocks`) <- ``streamer`` (the block scheduler), ``recompute`` (the
proxy block and its autograd Function), ``shards`` (safetensors reading); ``plan`` sizes it all.
"""

from .builders import stream_blocks
from .recompute import StreamedBlock
from .streamer import BlockStreamer

__all__ = ["BlockStreamer", "StreamedBlock", "stream_blocks"]
