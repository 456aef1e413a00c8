"""A checkpoint folder's manifest: its format version, `meta.json`, and the size and sha256 of every
file, checked before anything is read. Shared by training (zerodp.checkpoint) and conversion
(zerodp.convert), which import it and not each other."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from zerodp.errors import CheckpointError

FORMAT_VERSION = 1
META = "meta.json"


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """The file's sha256, read into one reused 1 MiB buffer: a fresh bytes object per read costs an
    allocation whose pages fault in each time (a quarter of the hashing time, measured on a 4.9 GB
    checkpoint). With `stop`, returns "" as soon as it is set."""
    h, buf = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])  # hashlib releases the GIL for large updates: threads hash in parallel
            if stop is not None and stop.is_set():
                return ""
    return h.hexdigest()


def verify(ckpt: Path, deep: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """Return None if `ckpt` is complete and intact, else the reason it is not (naming the file).

    Every file's presence and size are checked; with `deep`, the sha256 of the files in this
    `share` = (index, count) of the sorted manifest, so that `count` ranks together hash each file once."""
    meta_path = ckpt / META
    if not meta_path.is_file():
        return f"{ckpt} has no {META} (an interrupted save)"
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        return f"{meta_path} is not valid JSON ({e})"
    files = sorted(meta.get("files", {}).items())
    for rel, info in files:
        p = ckpt / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != info["bytes"]:
            return f"{p} has {p.stat().st_size} bytes, {info['bytes']} were saved (truncated or overwritten)"
    if deep:
        index, count = share
        for rel, info in files[index::count]:
            if sha256_file(ckpt / rel) != info["sha256"]:
                return f"{ckpt / rel} fails its sha256 check (corrupted)"
    return None


def resolve_step_folder(path: Path) -> Path | None:
    """A step folder for `path` if it is one, or an out_dir / checkpoints root (its `latest`)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    for root in (path / "checkpoints", path):
        latest = root / "latest"
        if latest.is_file():
            target = root / latest.read_text().strip()
            if (target / META).is_file():
                return target
            if target.name.startswith("step_"):
                raise CheckpointError(f"{latest} points to {target.name}, which has no {META} (missing or "
                                      f"interrupted); pass an intact step_ folder explicitly")
        steps = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / META).is_file())
        if steps and root.name == "checkpoints":
            return steps[-1]
    return None


class BackgroundVerify:
    """`verify(ckpt, deep=True)` begun now: sizes at once, the sha256 of every file in `threads` threads
    (largest files first), beside whatever the caller does meanwhile. `result()` waits and returns what
    verify would (None, or the reason naming the first file in manifest order that fails); `cancel()`
    stops the hashing of a check no longer wanted."""

    def __init__(self, ckpt: Path, threads: int = 2):
        self.ckpt = Path(ckpt)
        self.problem = verify(self.ckpt, deep=False)
        self._stop = threading.Event()
        self._failed: dict[str, str] = {}
        self._passed: set[str] = set()  # a file in neither (a thread died): the check fails, never passes
        self._threads: list[threading.Thread] = []
        if self.problem is not None:
            return
        files = sorted(json.loads((self.ckpt / META).read_text()).get("files", {}).items())
        self._order = [rel for rel, _ in files]
        queue = sorted(files, key=lambda item: -int(item[1]["bytes"]))
        lock = threading.Lock()

        def work() -> None:
            while not self._stop.is_set():
                with lock:
                    if not queue:
                        return
                    rel, info = queue.pop(0)
                try:
                    digest = sha256_file(self.ckpt / rel, self._stop)
                except OSError as e:  # removed or unreadable since the size check: a failure, never a pass
                    self._failed[rel] = f"{self.ckpt / rel} cannot be read ({e.strerror or e})"
                    continue
                if self._stop.is_set():
                    return
                if digest == info["sha256"]:
                    self._passed.add(rel)
                else:
                    self._failed[rel] = f"{self.ckpt / rel} fails its sha256 check (corrupted)"

        for i in range(max(1, min(threads, len(queue)))):
            t = threading.Thread(target=work, name=f"zerodp-sha256-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def result(self) -> str | None:
        for t in self._threads:
            t.join()
        if self.problem is None and self._stop.is_set():
            self.problem = f"the sha256 check of {self.ckpt} was stopped before it finished"
        if self.problem is None and len(self._passed) < len(self._order):
            self.problem = next((self._failed[rel] for rel in self._order if rel in self._failed),
                                f"the sha256 check of {self.ckpt} did not finish (a hashing thread failed)")
        return self.problem

    def cancel(self) -> None:
        if not any(t.is_alive() for t in self._threads):
            return  # finished: its result stands
        self._stop.set()
        for t in self._threads:
            t.join()
