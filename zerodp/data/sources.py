"""`zerodp prepare`'s inputs: text files, folders, JSONL (optionally .gz/.zst) and Parquet files, found
and read as documents in a stable order. No torch."""

from __future__ import annotations

import gzip
import io
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from zerodp.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".tex")  # as zerodp.data.batches reads
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


@dataclass
class Source:
    path: Path
    kind: str  # text | jsonl | parquet
    compression: str | None
    size: int  # bytes on disk
    given: bool  # named on the command line (an empty one is an error), not found in a folder
    documents: int = 0


def find_sources(inputs: list[str], field_name: str | None) -> list[Source]:
    """Every input file in document order; UserError for a missing input, a folder without inputs, an
    empty named file or a Parquet file without the text column `field_name` (None: not checked)."""
    sources = []
    for given in inputs:
        if given == "builtin":
            root = Path(sysconfig.get_paths()["stdlib"])
            sources += [Source(f, "text", None, f.stat().st_size, False) for f in sorted(root.glob("*.py"))]
            continue
        p = Path(given)
        if p.is_dir():
            found = [s for f in sorted(p.rglob("*")) if f.is_file() and not _hidden(f, p)
                     if (s := _source(f, False)) is not None]
            if not found:
                raise UserError(f"{p} holds no text ({', '.join(TEXT_SUFFIXES)}), JSONL ({', '.join(JSONL_SUFFIXES)}, "
                                f"optionally .gz/.zst) or Parquet files; point it at documents")
            sources += found
        elif p.is_file():
            sources.append(_source(p, True) or Source(p, "text", None, p.stat().st_size, True))
        else:
            raise UserError(f"input {given} not found; give text files, folders of them, .jsonl(.gz/.zst) or "
                            f".parquet files, or 'builtin'")
    for s in sources:
        if s.given and s.size == 0:
            raise UserError(f"{s.path} is empty; give files that hold documents")
        if s.kind == "parquet" and field_name is not None:
            _check_parquet(s.path, field_name)
    return sources


def sources_meta(sources: list[Source]) -> dict:
    """meta.json's record of what a prepare read: each source (path, kind, bytes, documents) and the bytes."""
    return {"sources": [{"path": str(s.path.resolve()), "kind": s.kind, "bytes": s.size, "documents": s.documents}
                        for s in sources],
            "bytes": sum(s.size for s in sources)}


def _hidden(f: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in f.relative_to(root).parts)


def _source(f: Path, given: bool) -> Source | None:
    suffixes = [s.lower() for s in f.suffixes[-2:]]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    base = (suffixes[:-1] or [""])[-1] if compression else (suffixes or [""])[-1]
    kind = "jsonl" if base in JSONL_SUFFIXES else "parquet" if base in PARQUET_SUFFIXES and not compression \
        else "text" if base in TEXT_SUFFIXES else None
    return None if kind is None else Source(f, kind, compression, f.stat().st_size, given)


CHAT_HINT = "these rows are conversations: prepare them with --chat (and --tokenizer a model with a chat template)"


PREFERENCE_HINT = "these rows are preference pairs: prepare them with --preference (for train.objective=dpo)"


def _chat_shaped(fields) -> bool:
    """Whether a row's fields (or a table's columns) are those of a conversation `prepare --chat` reads."""
    return "messages" in fields or {"prompt", "response"} <= set(fields)


def _row_hint(fields, otherwise: str) -> str:
    """What to do with rows of these fields that are not text: --preference, --chat, or `otherwise`."""
    if {"chosen", "rejected"} <= set(fields):
        return PREFERENCE_HINT
    return CHAT_HINT if _chat_shaped(fields) else otherwise


def _check_parquet(path: Path, column: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.ParquetFile(path).schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path} is not a Parquet file pyarrow can read ({str(e).splitlines()[0]})") from None
    if column not in schema.names:
        fix = _row_hint(schema.names, "name the text column with --field")
        raise UserError(f"{path} has no column {column!r} (its columns: {', '.join(schema.names)}); {fix}")
    t = schema.field(column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)
            or getattr(pa.types, "is_string_view", lambda _: False)(t)):
        raise UserError(f"column {column!r} of {path} holds {t}, not text; name the text column with --field")


def _open(path: Path, compression: str | None, raw) -> io.BufferedIOBase:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zstd":
        try:
            from compression import zstd  # Python 3.14+

            return zstd.ZstdFile(raw)
        except ImportError:
            pass
        try:
            import zstandard
        except ImportError:
            raise UserError(f"{path} is zstd-compressed; install zstandard (pip install zstandard) or give it "
                            f"decompressed") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw


def _documents(src: Source, column: str) -> Iterator[tuple[str, int]]:
    """(text, bytes of the file read since the document before) for each document of `src`."""
    if src.kind == "parquet":
        yield from _parquet_documents(src, column)
        return
    with open(src.path, "rb") as raw:
        try:
            stream = _open(src.path, src.compression, raw)
            if src.kind == "text":
                text = stream.read().decode("utf-8", errors="replace")
                if text:  # an empty file in a folder is no document (a named one was refused)
                    yield text, src.size
                return
            yield from _jsonl_documents(src, column, stream, raw)
        except UserError:
            raise
        except (EOFError, OSError, ValueError) as e:  # gzip.BadGzipFile, zlib.error, a truncated stream
            what = f"is not valid {src.compression}" if src.compression else "could not be read"
            raise UserError(f"{src.path} {what} ({e}); check the file") from None
        except Exception as e:
            if type(e).__name__ != "ZstdError":  # zstandard's own, not an OSError
                raise
            raise UserError(f"{src.path} is not valid zstd ({e}); check the file") from None


def _jsonl_documents(src: Source, column: str, stream, raw) -> Iterator[tuple[str, int]]:
    last = 0
    for n, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
            why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise UserError(f"{src.path}, line {n}: not JSON ({why}); each line must be one JSON object with a "
                            f"{column!r} string") from None
        if not isinstance(obj, dict) or column not in obj:
            has = f"its fields: {', '.join(obj)}" if isinstance(obj, dict) else f"it is a {type(obj).__name__}"
            raise UserError(f"{src.path}, line {n}: no field {column!r} ({has}); "
                            + (_row_hint(obj, "name the text field with --field") if isinstance(obj, dict) else
                               "name the text field with --field"))
        text = obj[column]
        if not isinstance(text, str):
            raise UserError(f"{src.path}, line {n}: field {column!r} is {json.dumps(text)[:40]}, not a string; "
                            f"name the text field with --field")
        pos = raw.tell()
        yield text, pos - last
        last = pos


def _parquet_documents(src: Source, column: str) -> Iterator[tuple[str, int]]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(src.path)
    total, done, row = max(f.metadata.num_rows, 1), 0, 0
    for batch in f.iter_batches(batch_size=4096, columns=[column]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise UserError(f"{src.path}, row {row}: column {column!r} is null; drop such rows or fill them")
            read = src.size * row // total - done
            done += read
            yield text, read



def records(src: Source, columns: tuple[str, ...]) -> Iterator[tuple[object, str, int]]:
    """(row, where: 'line N' / 'row N', bytes of the file read since the row before) for each row of a
    JSONL or Parquet `src`: a JSONL line's JSON value, a Parquet row's `columns` (those it has) as a dict.
    UserError for a line that is not JSON (naming the file and line) or a file that cannot be read."""
    if src.kind == "parquet":
        yield from _parquet_records(src, columns)
        return
    with open(src.path, "rb") as raw:
        try:
            stream, last = _open(src.path, src.compression, raw), 0
            for n, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                    raise UserError(f"{src.path}, line {n}: not JSON ({why}); each line must be one JSON "
                                    f"object") from None
                pos = raw.tell()
                yield obj, f"line {n}", pos - last
                last = pos
        except UserError:
            raise
        except (EOFError, OSError, ValueError) as e:
            what = f"is not valid {src.compression}" if src.compression else "could not be read"
            raise UserError(f"{src.path} {what} ({e}); check the file") from None
        except Exception as e:
            if type(e).__name__ != "ZstdError":
                raise
            raise UserError(f"{src.path} is not valid zstd ({e}); check the file") from None


def _parquet_records(src: Source, columns: tuple[str, ...]) -> Iterator[tuple[object, str, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(src.path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{src.path} is not a Parquet file pyarrow can read ({str(e).splitlines()[0]})") from None
    have = [c for c in columns if c in f.schema_arrow.names]
    if not have:
        raise UserError(f"{src.path} has none of the columns {', '.join(columns)} (its columns: "
                        f"{', '.join(f.schema_arrow.names)}); name them with --messages-field, --prompt-field "
                        f"and --response-field")
    total, done, row = max(f.metadata.num_rows, 1), 0, 0
    for batch in f.iter_batches(batch_size=1024, columns=have):
        for obj in batch.to_pylist():
            row += 1
            read = src.size * row // total - done
            done += read
            yield obj, f"row {row}", read
