"""The read engine: where a store's local arrays are read and decoded.

- :mod:`loader.engine.shards`: the direct reader of sharded zarr v3 arrays (byte
  ranges of inner chunks, decoded by blosc);
- :mod:`loader.engine.decoders`: decode processes that run a fetch's decode tasks;
- :mod:`loader.engine.buffers`: the pool of large fetch buffers (memory files);
- :mod:`loader.engine.cores`: how many cores this process may use.
"""

from loader.engine.config import EngineConfig
from loader.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
