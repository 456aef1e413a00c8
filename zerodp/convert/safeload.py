"""Loading `.pt` pickles without running code from them.

`torch.load(weights_only=True)` only rebuilds tensors and plain containers; anything else a pickle
asks for must be allowlisted. DeepSpeed's ZeRO files need a handful of DeepSpeed types (found with
pickletools on files written by DeepSpeed 0.19.8). We never import DeepSpeed: each allowed type is
a stand-in class registered under DeepSpeed's dotted name, which only stores the pickled fields.
A pickle asking for any other global (os.system, builtins.eval, ...) is refused before anything of
it runs, with a CheckpointError naming the file and the global.
"""

from __future__ import annotations

import argparse
import pickle
import re
from pathlib import Path

import torch

from zerodp.errors import CheckpointError


class _Fields:
    """Stand-in for a pickled DeepSpeed object: keeps its attributes, has no behaviour."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LossScaler(_Fields):
    pass


class DynamicLossScaler(_Fields):
    pass


class FragmentAddress(_Fields):
    pass


class ZeroStageEnum(int):
    """DeepSpeed pickles its ZeRO stage enum as ZeroStageEnum(value): an int is all we need."""


# (stand-in, the dotted name DeepSpeed's pickles use). The whole list: extend only with plain-data types.
DEEPSPEED_ALLOWLIST: list[tuple[type, str]] = [
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (argparse.Namespace, "argparse.Namespace"),  # engines built with `args=` pickle them in model states
]

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|unrecognized function (\S+)|got <class '([\w.]+)'>")


def safe_torch_load(path: Path, mmap: bool = True) -> dict:
    """torch.load(weights_only=True) with the DeepSpeed allowlist; CheckpointError on anything else.

    With mmap=True tensors stay in the file until touched, so opening a large shard costs little."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(DEEPSPEED_ALLOWLIST):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        m = _GLOBAL.search(str(e))
        what = next((g for g in m.groups() if g), None) if m else None
        if what:
            raise CheckpointError(
                f"{path} asks to load the global {what}, which is not on zerodp's allowlist of checkpoint "
                f"types; refusing to load it (a checkpoint must contain only tensors and plain data)"
            ) from None
        raise CheckpointError(f"{path} is not a loadable torch file ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is truncated or corrupted ({first})") from None


# ---- torch.distributed.checkpoint ---------------------------------------------------------------
# DCP pickles its `.metadata` (plain pickle.load in FileSystemReader) and loads non-tensor entries
# with torch.load(weights_only=False) (DefaultLoadPlanner.load_bytes). zerodp reads both through the
# allowlists below instead. The metadata types were found by tracing find_class on folders written
# by torch 2.13 (FSDP2 get_state_dict + dcp.save, and plain dcp.save).
_DCP_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},  # and every torch dtype, checked below
    "torch.serialization": {"_get_layout"},  # "torch.strided" -> the layout object
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or name in _DCP_METADATA_TYPES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


class _Record:
    """Stand-in for one of DCP's metadata dataclasses: keeps the pickled fields, has no behaviour."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict state, slot state)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class TensorProperties(_Record):
    def __setstate__(self, state):  # pickled as a tuple (torch's __getstate__)
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


# Stand-ins by DCP's class names: what zerodp.convert.dcp_ckpt reads of a folder's `.metadata` without
# importing torch.distributed.checkpoint (a second of CPU: it loads DTensor and sympy).
_DCP_STAND_INS = {name: type(name, (_Record,), {}) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "_StorageInfo")}
_DCP_STAND_INS["TensorProperties"] = TensorProperties
_DCP_STAND_INS["_MEM_FORMAT_ENCODING"] = int  # an Enum pickled as _MEM_FORMAT_ENCODING(value)


class _DcpMetadataStandInUnpickler(_DcpMetadataUnpickler):
    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") and name in _DCP_METADATA_TYPES.get(module, ()):
            return _DCP_STAND_INS[name]
        if module == "torch.serialization" and name == "_get_layout":
            import torch.serialization

            return torch.serialization._get_layout
        return super().find_class(module, name)


def read_dcp_metadata(path: Path):
    """A DCP folder's `.metadata`, unpickled with the allowlist into plain stand-in records (the same
    field names as torch.distributed.checkpoint.metadata's classes; no DCP import). CheckpointError on
    a global outside the allowlist; other errors (a truncated pickle) propagate."""
    with open(path, "rb") as f:
        try:
            return _DcpMetadataStandInUnpickler(f).load()
        except pickle.UnpicklingError as e:
            what = str(e).removeprefix("GLOBAL ")
            raise CheckpointError(f"{path} asks to load the global {what}, which is not on zerodp's allowlist "
                                  f"of checkpoint metadata types; refusing to load it") from None


def _safe_dcp_classes():
    """FileSystemReader and DefaultLoadPlanner with their pickle loads replaced by allowlisted ones
    (built on first use: importing torch.distributed.checkpoint is not free)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            # Unpickled once per reader: dcp.load asks for it on every call, and a reader used for many
            # loads (zerodp.convert.dcp_ckpt) would otherwise parse it every time (0.07 s at 300M params).
            cached = getattr(self, "_zerodp_metadata", None)
            if cached is not None:
                return cached
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = _DcpMetadataUnpickler(f).load()
                except pickle.UnpicklingError as e:
                    what = str(e).removeprefix("GLOBAL ")
                    raise CheckpointError(f"{path} asks to load the global {what}, which is not on zerodp's "
                                          f"allowlist of checkpoint metadata types; refusing to load it") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._zerodp_metadata = metadata
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            # DefaultLoadPlanner.load_bytes with weights_only=True: plain data (param groups, counters)
            from torch.distributed.checkpoint._traverse import set_element

            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeFileSystemReader, SafeLoadPlanner


def safe_dcp_reader(path) -> "object":
    """A torch.distributed.checkpoint storage reader whose metadata is unpickled with an allowlist."""
    reader, _ = _safe_dcp_classes()
    return reader(str(path))


def safe_dcp_planner() -> "object":
    """A load planner that reads non-tensor entries with torch.load(weights_only=True)."""
    _, planner = _safe_dcp_classes()
    return planner()
