"""Reading ahead of the writer: a background thread fetches the tensors a writer will ask for, in its
order, in batches (`CheckpointSource.get_many`: one pass over each DCP file per batch), and with
`prepare` casts and transposes them into the output's dtype and layout, while the writer writes the
ones already done. Reading, converting and writing overlap; memory stays bounded by `window` bytes of
tensors read and not yet written (counted at the larger of their stored and prepared sizes), plus the
tensor being written and the one being prepared: freed tensors go back to the operating system at
once (see `_tensors_back_to_the_os`).

    with read_ahead(source, [(name, kind), ...], window=1 << 30, prepare=cast) as src:
        t = src.get(name, kind)   # the next one in order: from the queue, prepared (cast(index, tensor));
                                  # anything else: read directly, as stored

The source's own files are never read by two threads at once (one lock around every read).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections import deque

import torch

DEFAULT_WINDOW = 256 << 20  # --max-memory's default: 256 MiB of tensors in flight


class ReadAhead:
    """A source whose `get` hands out, in the declared order, tensors a background thread read ahead."""

    def __init__(self, source, order: list[tuple[str, str]], nbytes: list[int], window: int, prepare=None):
        self.source = source
        self.prepare = prepare  # (index in order, tensor as stored) -> the tensor the writer wants
        self.order = list(order)
        self.nbytes = list(nbytes)
        self.window = max(int(window), 1)
        self.lock = threading.Lock()  # around every read of the source
        self.cond = threading.Condition()
        self.ready: deque[tuple[tuple[str, str], torch.Tensor]] = deque()
        self.in_flight = 0  # bytes read and not yet handed to the writer
        self.error: BaseException | None = None
        self.closed = False
        self.next = 0  # index in `order` of the next tensor the writer takes
        self.thread = threading.Thread(target=self._run, name="zerodp-read-ahead", daemon=True)

    def __getattr__(self, attr):  # everything but get: the source's own
        return getattr(self.source, attr)

    def _batches(self):
        """Consecutive runs of `order` of at most half the window each (at least one tensor), so that
        one batch is read while the one before it is written."""
        start, size = 0, 0
        for i, n in enumerate(self.nbytes):
            if i > start and size + n > self.window // 2:
                yield start, i
                start, size = i, 0
            size += n
        if start < len(self.order):
            yield start, len(self.order)

    def _run(self) -> None:
        try:
            for lo, hi in self._batches():
                need = sum(self.nbytes[lo:hi])
                with self.cond:  # room for this batch (or nothing in flight: a batch bigger than the window)
                    self.cond.wait_for(lambda: self.closed or self.in_flight == 0
                                       or self.in_flight + need <= self.window)
                    if self.closed:
                        return
                    self.in_flight += need
                with self.lock:
                    tensors = self.source.get_many(self.order[lo:hi])
                if self.prepare is not None:  # outside the lock: an out-of-order read need not wait for it
                    for i in range(len(tensors)):
                        tensors[i] = self.prepare(lo + i, tensors[i])
                with self.cond:
                    self.ready.extend(zip(self.order[lo:hi], tensors))
                    self.cond.notify_all()
                del tensors
        except BaseException as e:  # handed to the writer's thread, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        if self.next < len(self.order) and self.order[self.next] == (name, kind):
            with self.cond:
                self.cond.wait_for(lambda: self.ready or self.error is not None)
                if not self.ready:
                    raise self.error
                key, t = self.ready.popleft()
                self.in_flight -= self.nbytes[self.next]
                self.next += 1
                self.cond.notify_all()
            assert key == (name, kind), (key, name, kind)
            return t
        with self.lock:  # out of order (a tie check, a shape probe): read it now
            return self.source.get(name, kind)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.ready.clear()
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join()


def _tensors_back_to_the_os() -> None:
    """glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after which
    tensors of that size come from the heap and, once freed, stay in the process: a conversion's
    resident memory would then creep to window + many tensors. A fixed 1 MiB threshold (mallopt
    M_MMAP_THRESHOLD, which also turns the adjustment off) maps every tensor and unmaps it when freed.
    Other C libraries: nothing to do."""
    global _MALLOC_FIXED
    if _MALLOC_FIXED or not sys.platform.startswith("linux"):
        return
    _MALLOC_FIXED = True
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_MALLOC_FIXED = False


@contextlib.contextmanager
def read_ahead(source, order: list[tuple[str, str]], window: int = DEFAULT_WINDOW, prepare=None,
               prepared_nbytes: list[int] | None = None):
    """`source` reading `order` ahead in a background thread within `window` bytes, each tensor then
    passed through `prepare(index, tensor)` there (see the module). `prepared_nbytes`: the prepared
    tensors' sizes, where prepare changes them (a cast to a wider dtype)."""
    _tensors_back_to_the_os()
    nbytes = []
    for i, (name, kind) in enumerate(order):
        info = source.info(name)
        n = info.numel * (4 if kind != "param" else info.dtype.itemsize)
        nbytes.append(max(n, prepared_nbytes[i]) if prepared_nbytes else n)
    ahead = ReadAhead(source, order, nbytes, window, prepare)
    ahead.thread.start()
    try:
        yield ahead
    finally:
        ahead.close()
