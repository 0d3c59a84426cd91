"""The remote tier: KV blocks to and from another process's (or node's) host memory, through
NIXL, with the offloader's awaitable, ordered transfers.

`RemotePool` owns host memory and serves it (`python -m kvasync.serve`); `RemoteOffloader`
stores and loads blocks into a region of it. Importing this package does not import NIXL;
the first pool or offloader does (install the extra: ``pip install 'kvasync[nixl]'``).
"""

from __future__ import annotations

from ._offloader import RemoteOffloader
from ._pool import RemotePool

__all__ = ["RemoteOffloader", "RemotePool"]
