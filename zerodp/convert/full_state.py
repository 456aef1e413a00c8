"""Full fp32 tensors by the model's own parameter names, from any checkpoint source: what lets any
strategy at any world size start from a checkpoint written by any other, and what the Hugging Face and
zerodp writers read. It lives with the readers (strategies import it from here; nothing here imports a
strategy)."""

from __future__ import annotations

import contextlib

import torch


class FullState:
    """Full fp32 tensors by the model's own parameter names, from any checkpoint source
    (`zerodp.convert.open_checkpoint`): what lets any strategy at any world size start from a
    checkpoint written by any other. Shapes are checked; tied aliases are followed. Weights in Hugging
    Face's names and layouts (an HF model folder, a `--to hf` export) are read through the family's
    table in zerodp/models/hf.py (GPT-2's Conv1D weights transposed, GPT2Model's unprefixed names,
    HF's mask buffers ignored)."""

    def __init__(self, source, with_optimizer: bool):
        from zerodp.convert.source import names_layout
        from zerodp.errors import CheckpointError
        from zerodp.models import hf

        if source.meta.get("hf_config_error"):  # an HF folder of a model zerodp cannot run
            raise CheckpointError(source.meta["hf_config_error"])
        self.source = source
        stored_names = source.param_names()
        layout = names_layout(source)
        family = (source.meta.get("config") or {}).get("model", {}).get("arch") or hf.family_of_names(stored_names)
        # model name -> (stored name, transform): the table read backwards for HF weights, else the identity
        self.stored: dict[str, tuple[str, str | None]] = {}
        for n in stored_names:
            if layout == "hf" and family:
                if hf.is_buffer(family, n):
                    continue
                hit = hf.from_hf(family, n)
                self.stored[hit[0] if hit else n] = (n, hit[1]) if hit else (n, None)
            else:
                self.stored[n] = (n, None)
        model_name = {s: m for m, (s, _) in self.stored.items()}
        tied = {model_name.get(a, a): model_name.get(s, s) for a, s in source.tied().items()}
        self._tied = tied
        self.aliases = {**tied, **{stored: alias for alias, stored in tied.items()}}
        self.names = set(self.stored)
        self.with_optimizer = with_optimizer and all(source.has(s, "exp_avg") for s, _ in self.stored.values())

    def _stored(self, name: str) -> tuple[str, str | None]:
        for c in (name, self.aliases.get(name)):
            if c in self.stored:
                return self.stored[c]
        from zerodp.errors import CheckpointError

        raise CheckpointError(f"{self.source.path} has no parameter {name!r} (it has {len(self.names)}, e.g. "
                              f"{sorted(self.names)[:3]}); the model config must describe the checkpoint's model")

    def holds(self, name: str) -> bool:
        """Whether the source holds the model's parameter `name` (itself or its tied source): a LoRA
        checkpoint holds the adapters only, a base model's weights none of them."""
        return name in self.stored or self.aliases.get(name) in self.stored

    def stored_name(self, name: str) -> str:
        """The source's name for the model's parameter `name`."""
        return self._stored(name)[0]

    def stored_transposed(self, name: str) -> bool:
        """Whether the source keeps `name` transposed from the model's layout (HF's Conv1D weights)."""
        from zerodp.models.hf import TRANSPOSE

        return self._stored(name)[1] == TRANSPOSE

    @contextlib.contextmanager
    def reading_ahead(self, order: list[tuple[str, str]], window: int):
        """Within the block, the source is read ahead in `order` ((stored name, kind) pairs, as `get`
        will ask for them) by a background thread (zerodp.convert.stream.read_ahead)."""
        from zerodp.convert.stream import read_ahead

        source = self.source
        with read_ahead(source, order, window) as ahead:
            self.source = ahead
            try:
                yield self
            finally:
                self.source = source

    def param_names(self) -> list[str]:
        """The source's parameters by the model's names (a tied alias not listed), in the source's order."""
        return list(self.stored)

    def tied(self) -> dict[str, str]:
        """{alias: stored name} of the source's tied weights, by the model's names."""
        return dict(self._tied)

    def shape(self, name: str) -> tuple[int, ...]:
        """`name`'s shape in the model's layout, read from the source's header (no tensor data)."""
        from zerodp.models.hf import transposed

        stored, transform = self._stored(name)
        return transposed(self.source.info(stored).shape, transform)

    def source_dtype(self, name: str) -> torch.dtype:
        return self.source.info(self._stored(name)[0]).dtype

    def has(self, name: str, kind: str) -> bool:
        return self.source.has(self._stored(name)[0], kind)

    def mismatch(self, shapes: dict[str, tuple], may_lack=()) -> str | None:
        """Why the source cannot fill a model with these parameter `shapes` (None when it can): names
        missing there (but those of `may_lack`: what comes from elsewhere, as LoRA's base or its
        adapters), names there this model lacks, and shapes that differ, each with examples."""
        from zerodp.errors import CheckpointError

        used, missing, wrong = set(), [], []
        may_lack = set(may_lack)
        for name, shape in shapes.items():
            try:
                stored, _ = self._stored(name)
            except CheckpointError:
                if name not in may_lack:
                    missing.append(name)
                continue
            used.add(stored)
            have = self.shape(name)
            if have != tuple(shape):
                wrong.append(f"{name} is {list(have)} there, {list(shape)} here")
        extra = sorted(m for m, (s, _) in self.stored.items() if s not in used and m not in self.aliases)
        parts = []
        if missing:
            parts.append(f"{len(missing)} of this model's parameters are missing there (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} parameters there are not in this model (e.g. {extra[0]})")
        if wrong:
            parts.append(f"{len(wrong)} have another shape (e.g. {wrong[0]})")
        return "; ".join(parts) or None

    def get(self, name: str, kind: str, shape) -> torch.Tensor:
        from zerodp.models.hf import TRANSPOSE

        stored, transform = self._stored(name)
        t = self.source.get(stored, kind).float()
        if transform == TRANSPOSE:
            t = t.t().contiguous()  # HF's Conv1D keeps (in, out); nn.Linear (out, in)
        if tuple(t.shape) != tuple(shape):
            from zerodp.errors import CheckpointError

            raise CheckpointError(f"{self.source.path}: {name} has shape {tuple(t.shape)} there but {tuple(shape)} "
                                  f"in this model; set the model section to the checkpoint's dimensions")
        return t

    def step(self, name: str) -> float:
        s = self.source.step(self._stored(name)[0])
        return float(s) if s is not None else 0.0
