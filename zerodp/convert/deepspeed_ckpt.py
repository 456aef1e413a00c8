"""DeepSpeed ZeRO-1/2/3 checkpoints, read without DeepSpeed and without running pickled code.

What zero_to_fp32.py does for the fp32 weights, generalised to the Adam moments, which share the
fp32 partitions' flat layout:
  ZeRO-1/2: per param group, each rank holds one slice of a flat fp32 vector; concatenating the
            ranks' slices (the last rank's padding is not saved) and walking the group's parameters
            in order (plus per-parameter alignment padding) gives each parameter.
  ZeRO-3:   every parameter is split into world_size pieces of ceil(numel / world_size) (the last
            one padded); each rank's flat groups hold its pieces of all parameters in order.
Rank files are opened with mmap (tensors stay on disk until sliced), which also says where each flat
partition lies in its file: a parameter's pieces are then read with positioned reads straight into
place (`locate`, `get`), or copied file to file by a writer that keeps them as stored. Where a piece
cannot be located, it is copied out of the mapping and its pages are given back at once (madvise), so
resident memory stays bounded without re-opening the files (where madvise is missing: re-opened after
a byte budget).
"""

from __future__ import annotations

import gc
import math
import os
import re
from pathlib import Path

import torch

from zerodp.convert.mapped import _with_records, drop_pages, file_mappings, file_offset
from zerodp.convert.safeload import safe_torch_load
from zerodp.convert.source import MOMENTS, CheckpointSource, FileRanges, TensorInfo, check_kind
from zerodp.errors import CheckpointError

_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# Without madvise (not Linux): bytes sliced out of memory-mapped rank files before they are re-opened:
# pages read stay resident (and count in RSS) until then. 64 MiB bounds that at a cost in re-opening
# and garbage collection (measured with benchmarks/convert_memory.py: 256 MiB kept ~260 MiB resident;
# 32 MiB made conversion 1.5x slower; on Linux the re-opening was a third of the reading thread's time).
_TOUCH_BUDGET = 64 * 1024 * 1024


def find_deepspeed_dir(path: Path) -> Path | None:
    """The folder holding the `*_optim_states.pt` files: `path` itself, the tag in `path/latest`,
    the newest `global_step*` under `path`, or any sub-folder (as zerodp's ZeRO strategy nests it)."""
    path = Path(path)
    if _optim_files(path):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = path / latest.read_text().strip()
        if _optim_files(tag):
            return tag
    steps = sorted((p for p in path.glob("global_step*") if _optim_files(p)),
                   key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    if steps:
        return steps[-1]
    hits = sorted({p.parent for p in path.rglob("*_optim_states.pt")})
    return hits[0] if len(hits) == 1 else None


def _optim_files(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("*_optim_states.pt") if _OPTIM.match(p.name)) if d.is_dir() else []


def _numel(shape) -> int:
    return math.prod(shape)


class _Ranks:
    """Per-rank optimizer files, loaded lazily with mmap and re-opened after a byte budget."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.cache: dict[int, dict] = {}
        self.mapped: dict[int, list[tuple[int, int, int]]] = {}  # rank -> where its file is mapped
        self.touched = 0

    def osd(self, rank: int) -> dict:
        if rank not in self.cache:
            sd = safe_torch_load(self.files[rank], mmap=True)
            if "optimizer_state_dict" not in sd:
                raise CheckpointError(f"{self.files[rank]} has no optimizer_state_dict; not a ZeRO optimizer file")
            self.cache[rank] = sd["optimizer_state_dict"]
            self.mapped[rank] = file_mappings(self.files[rank])
        return self.cache[rank]

    def touch(self, nbytes: int) -> None:
        self.touched += nbytes
        if self.touched > _TOUCH_BUDGET:  # unmap: the pages read so far leave resident memory
            self.clear()
            self.touched = 0
            gc.collect()

    def clear(self) -> None:
        self.cache.clear()
        self.mapped.clear()


class DeepSpeedSource(CheckpointSource):
    format = "deepspeed"

    def __init__(self, path: Path):
        self.path = Path(path)
        found = find_deepspeed_dir(self.path)
        if found is None:
            raise CheckpointError(f"{self.path} holds no DeepSpeed *_optim_states.pt files (looked in it, its "
                                  f"`latest` tag and global_step* folders)")
        self.dir = found
        optim = _optim_files(found)
        by_rank = {}
        for p in optim:
            m = _OPTIM.match(p.name)
            if int(m.group(3)) != 0:
                raise CheckpointError(f"{p}: model-parallel (mp_rank > 0) DeepSpeed checkpoints are not supported; "
                                      f"convert with DeepSpeed's ds_to_universal.py first")
            by_rank[int(m.group(2))] = p
        if sorted(by_rank) != list(range(len(by_rank))):
            raise CheckpointError(f"{found}: optimizer files for ranks {sorted(by_rank)}; some rank's file is missing")
        self.optim_files = [by_rank[r] for r in range(len(by_rank))]
        self.ranks = _Ranks(self.optim_files)
        self._flat_at: dict[tuple[int, int, str], int | None] = {}  # (rank, group, kind) -> file offset (locate)
        self._fds: dict[str, int] = {}  # rank files opened for positioned reads (get)
        osd0 = self.ranks.osd(0)
        stage = int(osd0.get("zero_stage", -1))
        if stage == -1:  # BF16_Optimizer (zero1, bf16 with fp32 accumulation) records no zero_stage: its config does
            cfg = safe_torch_load(self.optim_files[0], mmap=True).get("ds_config") or {}
            stage = int((cfg.get("zero_optimization") or {}).get("stage", -1))
        pc = osd0.get("partition_count")
        world = max(pc) if isinstance(pc, list) else int(pc)
        if world != len(self.optim_files):
            raise CheckpointError(f"{found} was written by {world} ranks but holds {len(self.optim_files)} optimizer "
                                  f"files; a rank's file is missing or left over from another run")
        if stage not in (1, 2, 3):
            raise CheckpointError(f"{self.optim_files[0]} has zero_stage {stage}; only ZeRO stages 1-3 are supported")
        self.stage, self.world = stage, world
        model_file = found / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3
                              else "mp_rank_00_model_states.pt")
        if not model_file.is_file():
            raise CheckpointError(f"{model_file} is missing (DeepSpeed's model states file)")
        self.model_file = model_file
        ms = safe_torch_load(model_file, mmap=True)
        self.shapes_by_group: list[dict[str, tuple]] = [
            {n: tuple(s) for n, s in g.items()} for g in ms["param_shapes"]]
        self._infos = {n: TensorInfo(s, torch.float32) for g in self.shapes_by_group for n, s in g.items()}
        self._buffers = {n: ms["module"][n] for n in ms.get("buffer_names") or [] if n in ms["module"]}
        # The module's own copy of the trained weights (bf16 or fp32, ZeRO-1/2): never read, the fp32
        # partitions are; where it lies, for a check of only what is read (unread_ranges)
        self._module_ranges = []
        model_mapped = file_mappings(model_file)
        for n, t in ms["module"].items():
            if n in self._infos and t.numel() > 0 and (at := file_offset(t, model_mapped)) is not None:
                self._module_ranges.append((str(model_file), at, t.numel() * t.element_size()))
        self._frozen = dict(ms.get("frozen_param_shapes") or {})
        tied = {k: v for k, v in (ms.get("shared_params") or {}).items()}
        if stage == 3 and not tied:  # ZeRO-3 records no shared_params: an alias shares its storage
            by_storage = {ms["module"][n].untyped_storage()._cdata: n for g in self.shapes_by_group for n in g
                          if n in ms["module"]}
            for n, t in ms["module"].items():
                src = by_storage.get(t.untyped_storage()._cdata)
                if src is not None and src != n and n not in self._infos:
                    tied[n] = src
        dtype = "bf16" if self.optim_files[0].name.startswith("bf16_") else "fp32"
        cfg = ms.get("ds_config") or safe_torch_load(self.optim_files[0], mmap=True).get("ds_config") or {}
        if (cfg.get("fp16") or {}).get("enabled"):
            dtype = "fp16"
        elif (cfg.get("bf16") or {}).get("enabled"):
            dtype = "bf16"
        self.meta = {
            "strategy": f"zero{stage}", "zero_stage": stage, "world_size": world, "dtype": dtype,
            "step": ms.get("global_steps"), "ds_version": str(ms.get("ds_version") or osd0.get("ds_version")),
            "tied": tied, "tag": found.name,
        }
        self._frozen_vals = self._load_frozen(ms) if self._frozen else {}
        del ms
        self._layout()

    # -- layout -----------------------------------------------------------------------------------
    def _layout(self) -> None:
        """Where each parameter's elements live: a list of (rank, group, start, length) pieces."""
        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        lengths = []  # lengths[r][g]: numel of rank r's fp32 partition of group g
        for r in range(self.world):
            groups = self.ranks.osd(r).get(key)
            if groups is None:
                raise CheckpointError(f"{self.optim_files[r]} has no {key}; not a ZeRO-{self.stage} checkpoint")
            lengths.append([int(t.numel()) for t in groups])
        self.ranks.clear()
        self.pieces: dict[str, list[tuple[int, int, int, int]]] = {}
        self.group_of: dict[str, int] = {}
        osd0 = self.ranks.osd(0)
        if self.stage <= 2:
            paddings = osd0.get("param_alignment_paddings")
            for g, shapes in enumerate(self.shapes_by_group):
                starts = [0]
                for r in range(self.world):
                    starts.append(starts[-1] + lengths[r][g])
                offset = 0
                for i, (name, shape) in enumerate(shapes.items()):
                    n = _numel(shape)
                    self.pieces[name] = [(r, g, at, k) for r, at, k in self._overlaps(offset, n, starts)]
                    self.group_of[name] = g
                    offset += n + (paddings[g][i] if paddings else 0)
                align = 2 * self.world
                if math.ceil(offset / align) * align != math.ceil(starts[-1] / align) * align:
                    raise CheckpointError(f"{self.dir}: group {g} holds {starts[-1]} elements but its parameters "
                                          f"need {offset}; the files do not belong together")
        else:
            # Every rank's groups concatenated; a parameter's piece is at the same offset on each rank.
            gstarts = [0]
            for n in lengths[0]:
                gstarts.append(gstarts[-1] + n)
            offset = 0
            for shapes in self.shapes_by_group:
                for name, shape in shapes.items():
                    n = _numel(shape)
                    part = math.ceil(n / self.world)
                    pieces, left = [], n
                    for r in range(self.world):
                        take = min(part, left)
                        if take > 0:
                            pieces += [(r, g, at, k) for g, at, k in self._overlaps(offset, take, gstarts)]
                        left -= take
                    self.pieces[name] = pieces
                    self.group_of[name] = next(g for g in range(len(lengths[0]))
                                               if gstarts[g] <= offset < gstarts[g + 1]) if n else 0
                    offset += part
            if offset != gstarts[-1]:
                raise CheckpointError(f"{self.dir}: each rank holds {gstarts[-1]} elements but the parameters need "
                                      f"{offset}; the files do not belong together")

    @staticmethod
    def _overlaps(offset: int, n: int, bounds: list[int]) -> list[tuple[int, int, int]]:
        """(i, start inside slice i, length) for each slice [bounds[i], bounds[i+1]) that the range
        [offset, offset+n) overlaps: a parameter cut over ranks, or a rank's share cut over groups."""
        out, end = [], offset + n
        for i in range(len(bounds) - 1):
            lo, hi = max(offset, bounds[i]), min(end, bounds[i + 1])
            if lo < hi:
                out.append((i, lo - bounds[i], hi - lo))
        return out

    def _load_frozen(self, ms: dict) -> dict[str, torch.Tensor]:
        if self.stage <= 2:
            return {n: t.float().clone() for n, t in (ms.get("frozen_param_fragments") or {}).items()}
        frags = []
        for r in range(self.world):
            f = self.dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            frags.append(safe_torch_load(f, mmap=True).get("frozen_param_fragments") or {})
        return {n: torch.cat([fr[n] for fr in frags]).narrow(0, 0, _numel(s)).view(tuple(s)).float().clone()
                for n, s in self._frozen.items()}

    # -- the source interface -----------------------------------------------------------------------
    def param_names(self) -> list[str]:
        return list(self._buffers) + list(self._frozen) + list(self._infos)

    def info(self, name: str) -> TensorInfo:
        if name in self._infos:
            return self._infos[name]
        if name in self._frozen:
            return TensorInfo(tuple(self._frozen[name]), torch.float32)
        t = self._buffers[name]
        return TensorInfo(tuple(t.shape), torch.float32 if t.is_floating_point() else t.dtype)

    def kinds(self) -> tuple[str, ...]:
        return ("param",) + MOMENTS

    def has(self, name: str, kind: str) -> bool:
        return kind == "param" or name in self._infos

    def _state(self, rank: int, g: int) -> dict:
        base = self.ranks.osd(rank).get("base_optimizer_state" if self.stage <= 2 else "optimizer_state_dict")
        if isinstance(base, dict) and "state" in base:
            state = base["state"].get(g)
        elif isinstance(base, list):  # elastic checkpoints: one state dict per group
            state = base[g]
        else:
            state = None
        if not state:
            raise CheckpointError(f"{self.optim_files[rank]} has no optimizer state for group {g} "
                                  f"(saved before the first optimizer step?)")
        return state

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        check_kind(kind)
        if name not in self._infos:
            if kind != "param":
                raise KeyError(f"{name} is a buffer or frozen parameter; it has no {kind}")
            if name in self._frozen_vals:
                return self._frozen_vals[name]
            t = self._buffers[name]
            return t.float().clone() if t.is_floating_point() else t.clone()
        info = self._infos[name]
        out = torch.empty(info.numel, dtype=torch.float32)
        where = self.locate(name, kind)
        if where is not None:  # positioned reads straight into place: no page of the mapping is touched
            where.read_into(out, self._fds)
            return out.view(info.shape)
        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        at = 0
        for r, g, start, n in self.pieces[name]:
            if kind == "param":
                flat = self.ranks.osd(r)[key][g]
            else:
                flat = self._state(r, g)[kind]
            piece = flat.narrow(0, start, n)
            out[at:at + n].copy_(piece)
            at += n
            if not drop_pages(piece, self.ranks.mapped.get(r, [])):
                self.ranks.touch(4 * n)
        assert at == info.numel, (name, at, info.numel)
        return out.view(info.shape)

    def locate(self, name: str, kind: str = "param") -> FileRanges | None:
        """A parameter's pieces in the rank files: each a run of fp32 elements inside one flat partition
        (its offset read from where the mmap'd partition lies). None for buffers and frozen parameters."""
        if name not in self._infos:
            return None
        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        ranges = []
        for r, g, start, n in self.pieces[name]:
            if (r, g, kind) not in self._flat_at:  # each flat partition's place in its file, found once
                flat = self.ranks.osd(r)[key][g] if kind == "param" else self._state(r, g)[kind]
                ok = flat.dtype == torch.float32 and flat.is_contiguous()
                self._flat_at[(r, g, kind)] = file_offset(flat, self.ranks.mapped[r]) if ok else None
            at = self._flat_at[(r, g, kind)]
            if at is None:
                return None
            ranges.append((str(self.optim_files[r]), at + 4 * start, 4 * n))
        return FileRanges(tuple(ranges))

    def unread_ranges(self, kinds: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """The module's copy of the weights, each moment's whole flat partition not in `kinds`, and the
        zip record (local header and data) of every tensor wholly inside those: nothing in them is read."""
        ranges = list(self._module_ranges)
        for kind in [k for k in MOMENTS if k not in kinds]:
            for r in range(self.world):
                try:
                    groups = range(len(self.ranks.osd(r)["single_partition_of_fp32_groups" if self.stage <= 2
                                                         else "fp32_flat_groups"]))
                    flats = [self._state(r, g)[kind] for g in groups]
                except (CheckpointError, KeyError):  # no optimizer state saved: nothing there to leave out
                    return _with_records(ranges)
                for flat in flats:
                    at = file_offset(flat, self.ranks.mapped[r]) if flat.numel() else None
                    if at is not None:
                        ranges.append((str(self.optim_files[r]), at, flat.numel() * flat.element_size()))
        return _with_records(ranges)

    def step(self, name: str | None = None) -> float | None:
        if name is None or name not in self._infos:
            return super().step() if name is None else None
        # AdamW keeps one step per flat group: read it from the rank holding the parameter's first piece.
        r, g = self.pieces[name][0][:2] if self.pieces[name] else (0, self.group_of[name])
        s = self._state(r, g).get("step")
        return None if s is None else float(s)

    def loss_scaler(self) -> dict | None:
        """The fields of the ZeRO optimizer's loss scaler (cur_scale, and for fp16's dynamic scaling
        cur_iter, last_overflow_iter, cur_hysteresis...), as saved; None if the file has none."""
        scaler = self.ranks.osd(0).get("loss_scaler")
        return dict(vars(scaler)) if scaler is not None else None

    def files(self) -> list[Path]:
        models = sorted(self.dir.glob("*model_states.pt"))
        return models + self.optim_files

    def verify(self, deep: bool = True) -> str | None:
        """Every rank file present and loadable (a truncated zip fails to open)."""
        for f in self.files():
            if not f.is_file():
                return f"{f} is missing"
            try:
                safe_torch_load(f, mmap=True)
            except CheckpointError as e:
                return str(e)
        return None

    def close(self) -> None:
        self.ranks.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
