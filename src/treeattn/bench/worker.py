"""One benchmark rank as a process of its own: `python -m treeattn.bench.worker --config JSON`.

Used where ranks cannot be started by ta.spawn, e.g. inside network namespaces
(treeattn.bench.netns). The process group is joined through the environment (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE); rank 0 writes its records as JSON to --result.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from datetime import timedelta

import torch.distributed as dist

from treeattn.bench.config import SweepConfig
from treeattn.bench.runner import run_rank
from treeattn.parallel.spawn import exit_without_teardown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="SweepConfig as JSON (one world size)")
    parser.add_argument("--result", required=True, help="rank 0 writes its records here")
    parser.add_argument("--records", default=None, help="rank 0 appends each record here as a JSON line")
    args = parser.parse_args(argv)
    config = SweepConfig.from_json(args.config)
    dist.init_process_group(backend=config.backend, init_method="env://", timeout=timedelta(seconds=config.timeout))
    try:
        records = run_rank(dist.get_rank(), dist.get_world_size(), args.config, args.records)
        if dist.get_rank() == 0:
            tmp = args.result + ".tmp"
            with open(tmp, "w") as f:
                json.dump(records, f)
            os.replace(tmp, args.result)
    except BaseException:  # noqa: BLE001 -- report, then leave without waiting on peers that may be gone
        traceback.print_exc()
        exit_without_teardown(1)
    dist.destroy_process_group()
    exit_without_teardown(0)  # as ta.spawn's ranks: no interpreter teardown once the work is done


if __name__ == "__main__":
    main()
