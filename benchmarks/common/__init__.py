"""What the benchmarks share, one job per module.

- `load`: the add_sub load generator (raw HTTP/1.1 and HTTP/2 clients in client processes) and its run results.
- `machine`: waiting for a quiet machine, and measuring the CPU other processes took during a run.
- `servers`: transerve and Triton started on free ports (through tests/support), a transerve of another commit,
  the Triton venv that can run torch models.
- `results`: `--json PATH` output with the date, commit and machine, and the comma-list option type.
- `embedding`, `generation_models`, `decoding_step`: the models, loads and measures that more than one
  benchmark of the same family runs.
"""
