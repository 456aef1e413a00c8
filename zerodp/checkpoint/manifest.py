"""A checkpoint folder's manifest: its format version, `meta.json`, and the size and sha256 of every
file, checked before anything is read. Shared by training (zerodp.checkpoint.store) and conversion
(zerodp.convert), which import it and not each other."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from pathlib import Path

from zerodp.errors import CheckpointError

FORMAT_VERSION = 1
META = "meta.json"


BLOCK = 16 << 20  # a file longer than this also records the sha256 of each block of this many bytes


def sha256_file(path: Path, stop: threading.Event | None = None, start: int = 0, length: int | None = None) -> str:
    """The sha256 of the file (or of its bytes [start, start + length)), read into one reused 1 MiB
    buffer: a fresh bytes object per read costs an allocation whose pages fault in each time (a quarter
    of the hashing time, measured on a 4.9 GB checkpoint). With `stop`, returns "" as soon as it is set."""
    h, buf = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buf)
    left = length
    with open(path, "rb", buffering=0) as f:
        if start:
            f.seek(start)
        while (left is None or left > 0) and (n := f.readinto(view if left is None else view[:min(left, len(buf))])):
            h.update(view[:n])  # hashlib releases the GIL for large updates: threads hash in parallel
            if left is not None:
                left -= n
            if stop is not None and stop.is_set():
                return ""
    return h.hexdigest()


def file_record(path: Path, block: int = BLOCK) -> dict:
    """A file's manifest entry: {"bytes", "sha256"} and, for a file longer than `block`, "block_bytes" and
    "blocks" (the sha256 of each `block` bytes, the last one shorter), with which a reader that uses part
    of a file checks only the blocks it reads (`BackgroundVerify.plan`). The two hashes run in two
    threads: on a machine with cores to spare, no longer than the file's sha256 alone."""
    size = Path(path).stat().st_size
    record = {"bytes": size}
    if size <= block:
        record["sha256"] = sha256_file(path)
        return record
    blocks: list[str] = []

    def per_block() -> None:
        blocks.extend(sha256_file(path, start=at, length=block) for at in range(0, size, block))

    t = threading.Thread(target=per_block, name="zerodp-sha256-blocks", daemon=True)
    t.start()
    record["sha256"] = sha256_file(path)
    t.join()
    if len(blocks) != -(-size // block):
        raise OSError(f"{path}: its blocks could not be hashed")
    record.update(block_bytes=block, blocks=blocks)
    return record


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


_STEP_DIR = re.compile(r"step_\d{8}")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_step_name(name: str) -> bool:
    """Whether `name` is a published checkpoint's folder name, `step_` and eight digits."""
    return bool(_STEP_DIR.fullmatch(name))


def is_step_dir(p: Path) -> bool:
    """A published checkpoint's folder name: not `.tmp` (a save in progress) nor `.damaged` (set aside)."""
    return bool(_STEP_DIR.fullmatch(p.name)) and p.is_dir()


def recorded_step(ckpt: Path) -> int | None:
    """The training step a checkpoint's meta.json records, or None when it has no readable one."""
    try:
        return int(json.loads((ckpt / META).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_name(root: Path) -> str | None:
    """The folder name `root/latest` holds, or None when there is no `latest` (or it cannot be read)."""
    try:
        return (Path(root) / "latest").read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def checkpoint_order(root: Path) -> list[Path]:
    """Every published step folder of a checkpoints root, in the order a reader tries them: the folder
    `latest` names first, then the others by the step their meta.json records, newest first. This is the
    one rule resume, retention, `zerodp inspect`, `--dry-run` and conversion follow: a folder's name is
    not its step (an import or an earlier version may have named it otherwise), and `latest` is how a
    user chooses a checkpoint. Folders without a readable meta.json (interrupted) come last, by name;
    the caller's integrity check rejects them."""
    root = Path(root)
    if not root.is_dir():
        return []
    folders = [p for p in root.iterdir() if is_step_dir(p)]
    steps = {p: recorded_step(p) for p in folders}
    ordered = sorted(folders, key=lambda p: (steps[p] is not None, steps[p] or 0, p.name), reverse=True)
    named = latest_name(root)
    first = [p for p in ordered if p.name == named]
    return first + [p for p in ordered if p.name != named]


def stale_latest(root: Path) -> str | None:
    """Why `root/latest` cannot be followed (it names no published step folder), or None when it can
    or there is no `latest`: the readers then fall back to the newest intact checkpoint by step."""
    named = latest_name(root)
    if named is None or (_STEP_DIR.fullmatch(named) and (Path(root) / named).is_dir()):
        return None
    return f"{Path(root) / 'latest'} names {named!r}, which is not a checkpoint folder here"


def resolve_step_folder(path: Path) -> Path | None:
    """A step folder for `path` if it is one, or the checkpoint an out_dir or checkpoints root resumes
    from: the first of `checkpoint_order` that is complete (sizes checked; the sha256 is the reader's)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    for root in (path / "checkpoints", path):
        named = latest_name(root)
        if root.name != "checkpoints" and not (named or "").startswith("step_"):
            continue  # not zerodp's: a DeepSpeed save_dir's `latest` names a global_step folder
        problem, order = stale_latest(root), checkpoint_order(root)
        for candidate in order:
            damaged = verify(candidate, deep=False)
            if damaged is None:
                if problem:
                    print(f"zerodp: warning: {problem}; reading {candidate.name}, the newest intact checkpoint",
                          file=sys.stderr)
                return candidate
            problem = problem or f"{candidate.name} is damaged ({damaged})"
        if order:  # none is intact: the reader's own check says what is wrong with the first
            return order[0]
        if problem:
            raise CheckpointError(f"{problem}; pass an intact step_ folder explicitly")
    return None


class BackgroundVerify:
    """`verify(ckpt, deep=True)` begun now: sizes at once, the sha256 of every file in `threads` threads
    (largest first), beside whatever the caller does meanwhile. `result()` waits and returns what verify
    would (None, or the reason naming the first file in manifest order that fails); `cancel()` stops the
    hashing of a check no longer wanted.

    A file whose manifest entry has per-block hashes (`file_record`) is checked block by block, and those
    blocks wait for `plan(unread)`: a reader that knows which byte ranges it will never read (a
    weights-only conversion skips the optimizer moments) hands them over, and a block wholly inside them
    is not hashed: every byte the reader uses is still checked before anything is published. Without
    a plan, `result()` hashes them all."""

    def __init__(self, ckpt: Path, threads: int = 2):
        self.ckpt = Path(ckpt)
        self.problem = verify(self.ckpt, deep=False)
        self._stop = threading.Event()
        self._failed: dict[str, str] = {}
        self._good: dict[str, int] = {}  # file -> its jobs that passed (or were left out by the plan)
        self._threads: list[threading.Thread] = []
        self._planned = False
        self.hashed_bytes = 0  # what the threads read: the plan's effect, for tests and benchmarks
        if self.problem is not None:
            return
        files = sorted(json.loads((self.ckpt / META).read_text()).get("files", {}).items())
        self._order = [rel for rel, _ in files]
        self._jobs_of: dict[str, int] = {}
        whole, blocks = [], []  # (rel, start, length, sha256)
        for rel, info in sorted(files, key=lambda item: -int(item[1]["bytes"])):
            size, step = int(info["bytes"]), int(info.get("block_bytes") or 0)
            if info.get("blocks") and step > 0 and len(info["blocks"]) == -(-size // step):
                blocks += [(rel, at, min(step, size - at), digest)
                           for at, digest in zip(range(0, size, step), info["blocks"])]
                self._jobs_of[rel] = len(info["blocks"])
            else:
                whole.append((rel, 0, None, info["sha256"]))
                self._jobs_of[rel] = 1
        self._queue, self._held = whole, blocks
        self._cond = threading.Condition()

        def work() -> None:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop.is_set() or self._queue or not self._held)
                    if self._stop.is_set() or not self._queue:
                        return
                    rel, start, length, want = self._queue.pop(0)
                try:
                    digest = sha256_file(self.ckpt / rel, self._stop, start, length)
                except OSError as e:  # removed or unreadable since the size check: a failure, never a pass
                    self._failed.setdefault(rel, f"{self.ckpt / rel} cannot be read ({e.strerror or e})")
                    continue
                if self._stop.is_set():
                    return
                with self._cond:
                    self.hashed_bytes += length if length is not None else (self.ckpt / rel).stat().st_size
                    if digest == want:
                        self._good[rel] = self._good.get(rel, 0) + 1
                    elif length is None:
                        self._failed.setdefault(rel, f"{self.ckpt / rel} fails its sha256 check (corrupted)")
                    else:
                        self._failed.setdefault(rel, f"{self.ckpt / rel} fails its sha256 check (corrupted in bytes "
                                                     f"{start:,}-{start + length:,})")

        for i in range(max(1, min(threads, len(whole) + len(blocks)))):
            t = threading.Thread(target=work, name=f"zerodp-sha256-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def plan(self, unread: dict[str, list[tuple[int, int]]]) -> None:
        """Release the per-block jobs, leaving out each block wholly inside the (offset, length) ranges
        of its file (a path relative to the checkpoint) that the caller will never read. Once only:
        a later call, or one after `result()`, changes nothing."""
        if self.problem is not None or self._planned:
            return
        with self._cond:
            self._planned = True
            for block in self._held:
                rel, start, length, _ = block
                if _inside(start, start + length, unread.get(rel, ())):
                    self._good[rel] = self._good.get(rel, 0) + 1
                else:
                    self._queue.append(block)
            self._held = []
            self._cond.notify_all()

    def result(self) -> str | None:
        self.plan({})  # no plan: every block is read
        for t in self._threads:
            t.join()
        if self.problem is None and self._stop.is_set():
            self.problem = f"the sha256 check of {self.ckpt} was stopped before it finished"
        if self.problem is None and any(self._good.get(rel, 0) < n for rel, n in self._jobs_of.items()):
            self.problem = next((self._failed[rel] for rel in self._order if rel in self._failed),
                                f"the sha256 check of {self.ckpt} did not finish (a hashing thread failed)")
        return self.problem

    def cancel(self) -> None:
        if not any(t.is_alive() for t in self._threads):
            return  # finished: its result stands
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join()


def _inside(lo: int, hi: int, ranges) -> bool:
    """Whether [lo, hi) lies inside the union of the (offset, length) `ranges`."""
    for start, n in sorted(ranges):
        if start > lo:
            return False
        lo = max(lo, start + n)
        if lo >= hi:
            return True
    return lo >= hi
