"""Megatron-core's own blends of small corpora, for the tests of data.py's blends.

Run once by hand in a scratch venv outside the project (torch and megatron-core are never
dependencies of it; the suite only reads what this wrote):

    python3 -m venv /tmp/mcore && /tmp/mcore/bin/pip install torch megatron-core==0.16.1 pybind11
    /tmp/mcore/bin/python data/megatron/make_blend_fixtures.py       # writes data/megatron/blends/

It writes three corpora a, b and c (`<name>.bin/.idx`, documents of seeded random lengths whose
token is 1000 * document + position, through megatron/core/datasets/indexed_dataset.py's
IndexedDatasetBuilder) and, for every blend of BLENDS, what BlendedMegatronDatasetBuilder builds
from them (blended_megatron_dataset_builder.py, blended_dataset.py, helpers.cpp
build_blending_indices, gpt_dataset.py): per split its class, length, the blending indices
(dataset_index, dataset_sample_index) and the tokens of every sample in order, as
`expected.json`, with torch.randperm(n) seeded by each of RANDPERM's seeds (the order of
MegatronPretrainingRandomSampler, --dataloader-type cyclic).
"""
import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "blends")
CORPORA = {"a": (40, 1), "b": (25, 2), "c": (60, 3)}   # name: (documents, seed of their lengths)
SEQ_LENGTH, SEED, EOD = 8, 1234, 99
# name: (--data-path words or None, --split or None, per-split words or None, samples per split)
BLENDS = {
    "two_weighted": (["0.3", "a", "0.7", "b"], "70,20,10", None, (50, 10, 5)),
    "three_uneven": (["2", "a", "5", "b", "3", "c"], "90,10,0", None, (70, 9, 0)),
    "unweighted": (["a", "c"], "85,15", None, (30, 6, 0)),
    "per_split": (None, None, (["0.6", "a", "0.4", "c"], ["b"], ["1", "b", "3", "c"]),
                  (40, 8, 6)),
    "one_prefix": (["c"], "70,20,10", None, (30, 8, 4)),     # no blend: the default run's data
}

RANDPERM = {"n": (1, 2, 12, 40, 1000), "seeds": (0, 1, 2, 7)}


def write_corpora():
    for name, (documents, seed) in CORPORA.items():
        rng = np.random.RandomState(seed)
        builder = IndexedDatasetBuilder(os.path.join(HERE, name + ".bin"), dtype=np.int32)
        for d in range(documents):
            builder.add_item(torch.from_numpy(np.arange(rng.randint(1, 15)) + 1000 * d))
            builder.end_document()
        builder.finalize(os.path.join(HERE, name + ".idx"))


def build(words, split, per_split, sizes):
    prefix = lambda ws: [w if w[0].isdigit() else os.path.join(HERE, w) for w in ws]
    config = GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LENGTH, split=split,
        blend=get_blend_from_list(prefix(words)) if words else None,
        blend_per_split=[get_blend_from_list(prefix(ws)) for ws in per_split] if per_split
        else None,
        tokenizer=SimpleNamespace(eod=EOD, pad=-1, vocab_size=50000,
                                 unique_identifiers={"eod": EOD}), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, path_to_cache=None)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, config).build()


def describe(dataset):
    if dataset is None:
        return None
    out = {"class": type(dataset).__name__, "length": len(dataset),
           "tokens": [dataset[i]["tokens"].tolist() for i in range(len(dataset))]}
    if hasattr(dataset, "dataset_index"):
        out["dataset_index"] = dataset.dataset_index.tolist()
        out["dataset_sample_index"] = dataset.dataset_sample_index.tolist()
    return out


def main():
    os.makedirs(HERE, exist_ok=True)
    write_corpora()
    expected = {"seq_length": SEQ_LENGTH, "seed": SEED, "eod": EOD}
    for name, (words, split, per_split, sizes) in BLENDS.items():
        splits = build(words, split, per_split, sizes)
        expected[name] = {"data_path": words, "split": split, "per_split": per_split,
                          "sizes": sizes,
                          **{k: describe(d) for k, d in zip(("train", "valid", "test"), splits)}}
    expected["randperm"] = {f"{n},{seed}": torch.randperm(
        n, generator=torch.Generator().manual_seed(seed)).tolist()
        for n in RANDPERM["n"] for seed in RANDPERM["seeds"]}
    for name in CORPORA:            # GPTDataset's index caches (<name>/cache/), not kept
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"))
    print(f"wrote {HERE}")


if __name__ == "__main__":
    main()
