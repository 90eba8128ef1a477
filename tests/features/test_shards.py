"""Which rank caches what (``headkit.features.shards``), checked in one process: the split
rule, the balanced order probe sweeps use, and the refusals. The two-rank runs themselves
are in tests/model/test_ranks.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from headkit import BatchError, ConfigError, HeadConfig, HeadedModel, cache_features
from headkit.features.shards import (
    _agreed_specs,
    _agreed_targets,
    balanced_order,
    batches_of_rank,
    loader_of_rank,
    rows_of_rank,
)
from headkit.features.storage import _DiskWriter


@pytest.mark.parametrize("num_batches, world", [(6, 2), (7, 2), (7, 3), (1, 2), (2, 4), (0, 2)])
def test_each_rank_runs_one_contiguous_run_of_whole_batches(num_batches, world):
    runs = [batches_of_rank(num_batches, r, world) for r in range(world)]
    assert [b for run in runs for b in run] == list(range(num_batches))  # each once, in order
    sizes = [len(run) for run in runs]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_rows_follow_the_batches_one_process_would_run():
    # 11 rows in batches of 2: rows 0-5 (batches 0-2) and 6-10 (batches 3-5, the last short)
    assert [rows_of_rank(11, 2, r, 2) for r in (0, 1)] == [range(0, 6), range(6, 11)]
    # one row, two ranks: rank 1 runs nothing
    assert [rows_of_rank(1, 2, r, 2) for r in (0, 1)] == [range(0, 1), range(1, 1)]


def test_the_balanced_order_gives_each_rank_batches_of_every_length():
    lengths = torch.tensor([9, 1, 7, 3, 8, 2, 6, 4, 5, 10, 11])
    assert torch.equal(balanced_order(lengths, 2, 1), torch.argsort(lengths, stable=True))
    order = balanced_order(lengths, 2, 2)
    assert sorted(order.tolist()) == list(range(11))  # a permutation
    runs = [lengths[order[rows]] for rows in (rows_of_rank(11, 2, r, 2) for r in (0, 1))]
    for run in runs:
        assert torch.equal(run, run.sort().values)  # shortest first within a rank's run
    # sorted lengths come in batches (1,2) (3,4) (5,6) (7,8) (9,10) (11), dealt from the
    # longest: the short last batch stays last, and each rank gets short and long ones
    assert runs[0].tolist() == [1, 2, 5, 6, 9, 10]
    assert runs[1].tolist() == [3, 4, 7, 8, 11]


class _Stream(IterableDataset):
    def __iter__(self):
        yield from ({"input_ids": [5, 6]} for _ in range(4))


def test_what_cannot_be_split_across_ranks_is_refused():
    rows = [{"input_ids": [5, 6]}] * 4
    with pytest.raises(ConfigError, match="cannot split this DataLoader \\(it has no length\\)"):
        loader_of_rank(DataLoader(_Stream(), batch_size=2), 2, None, 0, 2)
    split = DataLoader(rows, sampler=DistributedSampler(rows, num_replicas=2, rank=0))
    with pytest.raises(ConfigError, match="it is already split per rank"):
        loader_of_rank(split, 2, None, 0, 2)
    with pytest.raises(ConfigError, match="needs a dataset with a length to split it"):
        loader_of_rank(iter(rows), 2, None, 0, 2)


def test_a_dataloader_is_split_by_its_own_batches_and_later_ones_are_never_read():
    read = []

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            read.append(i)
            return i

    loader = DataLoader(Rows(), batch_size=3)  # batches of rows 0-2, 3-5, 6-8, 9
    mine = loader_of_rank(loader, 3, None, 0, 2)
    assert len(mine) == 2
    assert [b.tolist() for b in mine] == [[0, 1, 2], [3, 4, 5]]
    assert read == list(range(6))  # rank 0 stops after its last batch
    assert [b.tolist() for b in loader_of_rank(loader, 3, None, 1, 2)] == [[6, 7, 8], [9]]


def test_gather_must_be_a_bool_and_false_only_applies_in_memory(tiny_gpt2, tmp_path):
    model = HeadedModel(tiny_gpt2, [HeadConfig("p", pred_for_sequence=True, loss_fct=None)])
    data = [{"input_ids": [5, 6, 7]}]
    with pytest.raises(ConfigError, match="gather=1 is invalid; True"):
        cache_features(model, data, gather=1)
    with pytest.raises(ConfigError, match="gather=False applies to storage='memory'"):
        cache_features(model, data, storage=tmp_path / "c", gather=False)
    # in one process the shard is the whole cache
    own = cache_features(model, data, gather=False, progress=False)
    assert len(own) == 1 and "shard" not in own.meta


def test_a_rank_that_cannot_see_the_folder_says_so(tmp_path):
    with pytest.raises(ConfigError, match="this rank does not see the folder rank 0 prepared"):
        _DiskWriter(tmp_path / "elsewhere", False, part="rank1-")


def test_what_the_ranks_report_must_agree():
    """What each rank reports after its pass (``combine`` gathers these): the same targets
    and the same array layouts on every rank that ran batches; nothing at all is an empty
    dataset."""
    spec = {"dtype": "float32", "shape": [3, 8]}
    ran = {"present": ["y"], "specs": {"features/L1.mean": spec}, "rows": 3}
    idle = {"present": None, "specs": {}, "rows": 0}
    assert _agreed_targets([ran, idle]) == {"y"}
    assert _agreed_specs([ran, idle, ran])["features/L1.mean"] == {**spec, "shape": [6, 8]}
    other = {**ran, "specs": {"features/L1.mean": {"dtype": "float16", "shape": [2, 8]}}}
    with pytest.raises(BatchError, match="features/L1.mean: rank 1 cached float16 rows"):
        _agreed_specs([ran, other])
    with pytest.raises(BatchError, match="the dataset is empty: there is nothing to cache"):
        _agreed_targets([idle, idle])
