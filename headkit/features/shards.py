"""Feature caching split across the ranks of a process group.

**Which rank runs what.** The dataset is cut into the batches one process would run (rows
``0..B-1``, ``B..2B-1``, ... for ``batch_size`` B; a DataLoader's own batches); each rank
runs one contiguous run of whole batches, the first ``num_batches % world`` ranks one batch
more than the others (``batches_of_rank``). A rank past the last batch (fewer batches than
ranks) runs nothing and still takes part in the exchange. Every batch is exactly one a single
process would run, so each row's features are those of a single-process run.

**What each rank gets back.** In memory, ``gather=True``: the whole cache, rows in the
dataset's order (every array all-gathered); ``gather=False``: its own rows only, with
``meta["shard"]`` saying which. In a folder (which every rank must see): rank 0 prepares the
folder; each rank writes its own part files (``rank<r>-*.bin``) during the pass; then each rank
after 0 copies its part into rank 0's file of each array at its byte offset and deletes its
part (rank 0's part is the start of the file, never copied), and after a barrier rank 0 writes
the token offsets and the one ``manifest.json`` (atomically). The folder is then exactly what
one process writes, and every rank opens it (memory-mapped).

A failure on any rank (a bad batch, a folder another machine cannot see) becomes the same
error on every rank (``ranks.agree``), so no rank waits for a peer that stopped.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from ..distributed.ranks import agree, gather_json, gather_rows
from ..errors import BatchError, ConfigError
from .storage import _TORCH_DTYPES, CachedFeatures, _DiskWriter, _MemoryWriter

#: What ``pass_fn`` returns: the targets every batch had labels for (None: it ran no batch)
#: and the real tokens of each sequence, in order.
PassResult = tuple[set[str] | None, list[int]]


def batches_of_rank(num_batches: int, rank: int, world: int) -> range:
    """The batch indices ``rank`` runs: one contiguous run; the first ``num_batches % world``
    ranks get one batch more than the rest (see module docstring)."""
    base, extra = divmod(num_batches, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def rows_of_rank(num_rows: int, batch_size: int, rank: int, world: int) -> range:
    """The dataset rows ``rank`` runs: the rows of its batches (``batches_of_rank``)."""
    batches = batches_of_rank(-(-num_rows // batch_size), rank, world)
    return range(
        min(batches.start * batch_size, num_rows), min(batches.stop * batch_size, num_rows)
    )


def balanced_order(lengths: torch.Tensor, batch_size: int, world: int) -> torch.Tensor:
    """An order of the rows (by ``lengths``, shortest first within each rank's run) such
    that the contiguous runs of batches ``batches_of_rank`` gives each rank hold batches of
    every length: the batches of the length-sorted rows are dealt to the ranks in turn,
    from the longest (a last, partial batch stays last). With one rank: the sorted order."""
    order = torch.argsort(lengths, stable=True)
    batches = list(torch.split(order, batch_size))
    if world == 1:
        return order
    runs = [len(batches_of_rank(len(batches), r, world)) for r in range(world)]
    dealt: list[list[torch.Tensor]] = [[] for _ in range(world)]
    rank = max(r for r in range(world) if runs[r])
    for batch in reversed(batches):
        while len(dealt[rank]) == runs[rank]:
            rank = (rank - 1) % world
        dealt[rank].insert(0, batch)
        rank = (rank - 1) % world
    return torch.cat([b for run in dealt for b in run])


def loader_of_rank(
    data: Any, batch_size: int, collate_fn: Any, rank: int, world: int
) -> Iterable[Any]:
    """This rank's batches: ``data`` (a sized dataset) cut to its rows and batched, or, for
    a DataLoader, its batches of the loader's own (earlier ones are read and dropped)."""
    if isinstance(data, DataLoader):
        loader = data
        try:
            total = len(loader)
        except TypeError:
            total = None
        if total is None or _split_already(loader):
            raise ConfigError(
                f"cache_features on {world} ranks cannot split this DataLoader "
                f"({'it has no length' if total is None else 'it is already split per rank'}); "
                "pass the whole dataset (or a DataLoader over it, unsplit and with a length): "
                "cache_features splits it itself"
            )
        return _Batches(loader, batches_of_rank(total, rank, world))
    try:
        total = len(data)
    except TypeError:
        raise ConfigError(
            f"cache_features on {world} ranks needs a dataset with a length to split it; got "
            f"{type(data).__name__} without one (pass a list, a map-style or datasets.Dataset)"
        ) from None
    rows = rows_of_rank(total, batch_size, rank, world)
    return DataLoader(Subset(data, rows), batch_size=batch_size, collate_fn=collate_fn)


def _split_already(loader: DataLoader) -> bool:
    """A loader that gives each rank its own share (a DistributedSampler, accelerate's)."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    return isinstance(sampler, DistributedSampler) or type(loader).__module__.startswith(
        "accelerate"
    )


class _Batches:
    """The batches of ``loader`` whose index is in ``keep`` (a range), in order."""

    def __init__(self, loader: Iterable, keep: range) -> None:
        self.loader, self.keep = loader, keep

    def __len__(self) -> int:
        return len(self.keep)

    def __iter__(self) -> Iterator[Any]:
        if not self.keep:
            return
        for i, batch in enumerate(self.loader):
            if i >= self.keep.start:
                yield batch
            if i + 1 >= self.keep.stop:
                return


def rank_writer(storage: Path, overwrite: bool, rank: int) -> _DiskWriter:
    """This rank's writer into ``storage``: rank 0 prepares the folder first (checks,
    clears with ``overwrite``), then every other rank opens its part files there."""
    writer, error = None, None
    if rank == 0:
        try:
            writer = _DiskWriter(storage, overwrite)
        except BaseException as e:  # every rank must hear of it (ranks.agree)
            error = e
    agree(error, f"preparing storage={str(storage)!r}")
    if rank > 0:
        try:
            writer = _DiskWriter(storage, overwrite, part=f"rank{rank}-")
        except BaseException as e:
            error = e
    agree(error, f"opening storage={str(storage)!r}")
    assert writer is not None
    return writer


def combine(
    writer: _MemoryWriter | _DiskWriter,
    pass_fn: Callable[[], PassResult],
    meta_of: Callable[[set[str], int, int], dict[str, Any]],
    need_tokens: bool,
    gather: bool,
    rank: int,
) -> CachedFeatures:
    """Run this rank's pass, then put the ranks' parts together (see module docstring).

    ``meta_of(targets, num_sequences, num_tokens)`` gives the cache's ``meta``."""
    present, lengths, error = None, [], None
    try:
        present, lengths = pass_fn()
        if isinstance(writer, _DiskWriter):
            writer.close()
    except BaseException as e:  # every rank must hear of it (ranks.agree)
        error = e
    agree(error, "caching features")
    mine = {"present": None if present is None else sorted(present), "specs": writer.specs}
    mine["rows"] = len(lengths)
    reports = gather_json(mine)
    present_all = _agreed_targets(reports)
    specs = _agreed_specs(reports)
    if not gather:
        return _own_shard(writer, specs, lengths, present_all, meta_of, need_tokens, reports, rank)
    all_lengths = gather_rows(torch.tensor(lengths, dtype=torch.long)).tolist()
    offsets = [0]
    for n in all_lengths:
        offsets.append(offsets[-1] + n)
    meta = meta_of(present_all, len(all_lengths), offsets[-1] if need_tokens else 0)
    if isinstance(writer, _MemoryWriter):
        arrays = {name: gather_rows(_local(writer, name, spec)) for name, spec in specs.items()}
        if need_tokens:
            arrays["offsets"] = torch.tensor(offsets, dtype=torch.long)
        return CachedFeatures(arrays, meta)
    return _merge_files(writer, reports, offsets if need_tokens else None, meta, rank)


def _agreed_targets(reports: list[dict[str, Any]]) -> set[str]:
    """The labelled targets, the same on every rank that ran batches."""
    seen = {r: tuple(rep["present"]) for r, rep in enumerate(reports) if rep["present"] is not None}
    if not seen:
        raise BatchError("the dataset is empty: there is nothing to cache")
    if len(set(seen.values())) > 1:
        raise BatchError(
            "the ranks' batches have labels for different targets: "
            + ", ".join(f"rank {r}: {list(t)}" for r, t in seen.items())
            + "; every batch needs the same targets"
        )
    return set(next(iter(seen.values())))


def _agreed_specs(reports: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each array's dtype and row shape, the same on every rank that wrote it (rank 0's
    order); its rows summed over the ranks."""
    specs: dict[str, dict[str, Any]] = {}
    for rank, rep in enumerate(reports):
        for name, spec in rep["specs"].items():
            known = specs.setdefault(name, {**spec, "shape": [0, *spec["shape"][1:]]})
            if known["dtype"] != spec["dtype"] or known["shape"][1:] != spec["shape"][1:]:
                raise BatchError(
                    f"{name}: rank {rank} cached {spec['dtype']} rows of shape "
                    f"{tuple(spec['shape'][1:])}, an earlier rank {known['dtype']} rows of "
                    f"shape {tuple(known['shape'][1:])}; labels and features must keep one "
                    "dtype and shape across batches"
                )
            known["shape"][0] += spec["shape"][0]
    return specs


def _local(writer: _MemoryWriter, name: str, spec: dict[str, Any]) -> torch.Tensor:
    """This rank's rows of array ``name`` (none when it ran no batch)."""
    if name in writer.parts:
        return torch.cat(writer.parts[name])
    return torch.empty((0, *spec["shape"][1:]), dtype=_TORCH_DTYPES[spec["dtype"]])


def _own_shard(writer: _MemoryWriter, specs, lengths, present, meta_of, need_tokens, reports, rank):
    """``gather=False``: this rank's rows alone, ``meta["shard"]`` saying which they are."""
    arrays = {name: _local(writer, name, spec) for name, spec in specs.items()}
    offsets = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
    if need_tokens:
        arrays["offsets"] = offsets
    meta = meta_of(present, len(lengths), int(offsets[-1]) if need_tokens else 0)
    start = sum(rep["rows"] for rep in reports[:rank])
    meta["shard"] = {
        "rank": rank,
        "world_size": len(reports),
        "start": start,
        "stop": start + len(lengths),
        "num_sequences_total": sum(rep["rows"] for rep in reports),
    }
    return CachedFeatures(arrays, meta)


def _nbytes(spec: dict[str, Any] | None) -> int:
    if spec is None:
        return 0
    size = torch.empty((), dtype=_TORCH_DTYPES[spec["dtype"]]).element_size()
    return size * int(torch.tensor(spec["shape"], dtype=torch.long).prod())


def _merge_files(writer: _DiskWriter, reports, offsets, meta, rank: int) -> CachedFeatures:
    """Ranks after 0 copy their part files into rank 0's at their byte offsets; then rank 0
    writes the token offsets and the manifest, and every rank opens the folder."""
    error = None
    try:
        for name, spec in writer.specs.items() if rank > 0 else ():
            final = writer.path / reports[0]["specs"][name]["file"]
            start = sum(_nbytes(reports[r]["specs"].get(name)) for r in range(rank))
            part = writer.path / spec["file"]
            with open(part, "rb") as src, open(final, "r+b") as dst:
                dst.seek(start)
                shutil.copyfileobj(src, dst, 16 * 2**20)
            part.unlink()
    except BaseException as e:  # every rank must hear of it (ranks.agree)
        error = e
    agree(error, f"merging the ranks' files in {str(writer.path)!r}")
    if rank == 0:
        try:
            for name, spec in writer.specs.items():
                spec["shape"][0] = sum(
                    rep["specs"].get(name, {"shape": [0]})["shape"][0] for rep in reports
                )
            if offsets is not None:
                writer.append("offsets", torch.tensor(offsets, dtype=torch.long))
            writer.finish(meta)
        except BaseException as e:
            error = e
    agree(error, f"writing the manifest in {str(writer.path)!r}")
    return CachedFeatures.load(writer.path)


__all__ = ["balanced_order", "batches_of_rank", "combine", "rank_writer", "rows_of_rank"]
