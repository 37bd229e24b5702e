"""Load a dataset from a Hub name, a local folder (saved or of data files), or json/jsonl/parquet/csv files."""

from __future__ import annotations

import os

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _builder_for(path: str) -> str | None:
    name = path[:-3] if path.endswith(".gz") else path
    return FILE_BUILDERS.get(os.path.splitext(name)[1].lower())


def load_dataset_source(name: str, config: str | None = None):
    """Return a DatasetDict for whatever `name` points at."""
    import datasets

    files = [p.strip() for p in name.split(",") if p.strip()]
    builders = {_builder_for(p) for p in files}
    if all(os.path.isfile(p) for p in files):
        if None in builders or len(builders) != 1:
            raise ValueError(f"Unsupported data file type in {files}; use one of {sorted(FILE_BUILDERS)} (optionally .gz).")
        return datasets.load_dataset(builders.pop(), data_files={"train": files})
    if os.path.isdir(name):
        if os.path.exists(os.path.join(name, "dataset_dict.json")) or os.path.exists(os.path.join(name, "state.json")):
            loaded = datasets.load_from_disk(name)
            return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})
        return datasets.load_dataset(name, config)
    if any(os.sep in p or _builder_for(p) for p in files) and not os.path.exists(files[0]):
        raise FileNotFoundError(f"No such dataset file or folder: {name!r}.")
    return datasets.load_dataset(name, config)
