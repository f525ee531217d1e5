"""The benchmark: greedy and speculative decoding on one streaming model, side by side in one process, and
mlx-lm's in-memory model beside them.

``run`` warms both paths for ``warmup_tokens``, then times each ``repeat`` times and reports medians; the
counters come from the last run of each path (the store is reset before every run). With ``compare_inmemory``
mlx-lm's in-memory model is loaded once the streaming model is gone and timed the same way: ``table``'s rows
give each path's tok/s, its ratio to in-memory, hit rate, bytes read, the memory each model held (its weight
arrays, and MLX's peak above what MLX held before it was built) and whether its ids equal in-memory's.
``mlx-streaming bench`` with no options runs it on the default model at a quarter-size pool read with the page
cache bypassed (``cli.BENCH_DEFAULTS``). Decode tok/s starts
after the prompt's prefill. Ratios (speedup, disk-load ratio, streaming / in-memory) are measured in the
same process and are comparable across machines; absolute tok/s are not. ``sweep`` is the pool-size /
io-mode table: mlx-lm in-memory against streaming at several pools, greedy only.

A ``buffered`` figure read from a page cache that holds the shards measures memory copies, not the disk;
``direct`` bypasses the cache (O_DIRECT / F_NOCACHE). Every result names its io mode.
"""

from .main import run, table
from .sweep import sweep, sweep_table, noise_floor
from .io_report import raw_read_probe, io_ceiling, io_report, io_table
from .auto import k_report, prefetch_auto_report, auto_table, prefetch_report, prefetch_table
from .overhead import overhead_report, overhead_table
from .loops import loops_report, loops_table

__all__ = ["run", "table", "sweep", "sweep_table", "noise_floor", "raw_read_probe", "io_ceiling", "io_report", "io_table", "k_report", "prefetch_auto_report", "auto_table", "prefetch_report", "prefetch_table", "overhead_report", "overhead_table",
           "loops_report", "loops_table"]
