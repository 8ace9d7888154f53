"""Rows of a dataset read by range (fsdp_opt.data.sources.open_source) next to the same rows from
`datasets.load_dataset` of the whole split, in a process whose HF_ENDPOINT is the loopback Hub.

    python hub_rows.py OUT.json DATASET CONFIG|- SPLIT START:END [START:END ...]

Writes {"rows": N, "columns": [...], "identity": {...}, "ranges": {"a:b": {"ours": [...], "theirs": [...]}}},
each side's rows as JSON. With FSDP_OPT_NO_REFERENCE=1 the whole-split load is left out.
"""

from __future__ import annotations

import json
import os
import sys

from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sources import open_source


def main() -> None:
    out, dataset, config, split, *ranges = sys.argv[1:]
    src = DataSource(dataset, None if config == "-" else config, split)
    table = open_source(src)
    result = {"rows": len(table), "columns": table.column_names, "identity": table.identity, "ranges": {}}
    theirs = None
    if os.environ.get("FSDP_OPT_NO_REFERENCE") != "1":
        import datasets

        theirs = datasets.load_dataset(dataset, src.config, split=split)
    for spec in ranges:
        a, b = (int(x) for x in spec.split(":"))
        entry = {"ours": table.rows(a, b, table.column_names)}
        if theirs is not None:
            entry["theirs"] = list(theirs.select(range(a, b)))
        result["ranges"][spec] = entry
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
