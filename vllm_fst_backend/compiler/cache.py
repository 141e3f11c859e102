"""LRU cache of compiled automata, bounded in bytes, thread-safe.

Key: ``(regex, options, tokenizer fingerprint)``. Size of an entry: :attr:`CompiledAutomaton.nbytes`.
Concurrent requests for the same missing key compile once: the first caller compiles while the others
wait on a per-key event. Errors are not cached (a bad regex raises every time, cheaply).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .compile import compile_regex
from .options import CompileOptions

__all__ = ["CompiledCache"]


class CompiledCache:
    """Thread-safe LRU of :class:`CompiledAutomaton`, bounded by total ``nbytes``.

    Args:
        max_bytes: budget in bytes (default 512 MiB). An automaton larger than the whole budget is
            returned but not kept.

    Attributes:
        hits, misses (int): counters; ``nbytes``: bytes currently held; ``len(cache)``: entries.
    """

    def __init__(self, max_bytes: int = 512 * 1024 * 1024):
        self.max_bytes = int(max_bytes)
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(regex: str, options: CompileOptions, artifacts) -> tuple:
        """The cache key of a request."""
        return (regex, options, artifacts.fingerprint)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def get(self, key):
        """The cached automaton for ``key`` (marking it recently used), or None."""
        with self._lock:
            e = self._data.get(key)
            if e is None:
                return None
            self._data.move_to_end(key)
            return e[0]

    def put(self, key, value) -> None:
        """Insert ``value`` (evicting least recently used entries to stay within ``max_bytes``)."""
        size = int(getattr(value, "nbytes", 0) or 0)  # recorded now: a factored automaton's row memo may grow later
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            if size > self.max_bytes:
                return
            self._data[key] = (value, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes and self._data:
                _, ev = self._data.popitem(last=False)
                self.nbytes -= ev[1]

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._data.clear()
            self.nbytes = 0

    def get_or_compile(self, regex: str, artifacts, options: CompileOptions | None = None, *, compile_fn=None,
                       **kw):
        """The automaton of ``(regex, options)`` for ``artifacts``, compiling it on a miss with
        ``compile_fn(regex, artifacts, options, **kw)`` (default :func:`compile_regex`).

        Raises: whatever ``compile_fn`` raises (not cached).
        """
        options = options or CompileOptions()
        key = self.key(regex, options, artifacts)
        while True:
            with self._lock:
                e = self._data.get(key)
                if e is not None:
                    self._data.move_to_end(key)
                    self.hits += 1
                    return e[0]
                ev = self._pending.get(key)
                if ev is None:
                    ev = self._pending[key] = threading.Event()
                    self.misses += 1
                    owner = True
                else:
                    owner = False
            if not owner:
                ev.wait()
                with self._lock:
                    e = self._data.get(key)
                v = e[0] if e is not None else None
                if v is not None:
                    with self._lock:
                        self.hits += 1
                    return v
                continue  # the owner failed or the entry was too large: try ourselves
            try:
                v = (compile_fn or compile_regex)(regex, artifacts, options, **kw)
                self.put(key, v)
                return v
            finally:
                with self._lock:
                    self._pending.pop(key, None)
                ev.set()
