"""Logging a run's per-step metrics (``Optimizer.register_metrics_hook``).

    from zopt.metrics import CSVLogger
    log = CSVLogger("run.csv")
    opt.register_metrics_hook(log)     # one row per opt.step()
    ...
    log.close()

Columns: step, loss, grad_norm, skipped, loss_scale, lr0, lr1, ... (one
per param group), active_tensors, updated_elems, step_time_s, overhead_s,
bytes, bytes_per_s, refreshes, rebuilds (docs/USAGE.md section 9 says
what each is).
"""
from __future__ import annotations

import csv

FIELDS = ("step", "loss", "grad_norm", "skipped", "loss_scale", "lr", "active_tensors",
          "updated_elems", "step_time_s", "overhead_s", "bytes", "bytes_per_s",
          "refreshes", "rebuilds")


class CSVLogger:
    """A metrics hook writing one CSV row per step (flushed every
    ``flush_every`` rows). ``extra``: a callable returning a dict of more
    columns (e.g. the data loader's epoch), evaluated per row."""

    def __init__(self, path, flush_every=1, extra=None):
        self.path = path
        self._f = open(path, "w", newline="")
        self._w = None
        self._n = 0
        self.flush_every = max(1, int(flush_every))
        self.extra = extra

    def _row(self, m):
        row = {}
        for k in FIELDS:
            if k == "lr":
                for i, v in enumerate(m["lr"]):
                    row[f"lr{i}"] = v
            else:
                v = m[k]
                row[k] = int(v) if isinstance(v, bool) else v
        if self.extra is not None:
            row.update(self.extra())
        return row

    def __call__(self, opt, m):
        row = self._row(m)
        if self._w is None:
            self._w = csv.DictWriter(self._f, fieldnames=list(row))
            self._w.writeheader()
        self._w.writerow(row)
        self._n += 1
        if self._n % self.flush_every == 0:
            self._f.flush()

    def close(self):
        if not self._f.closed:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_csv(path):
    """The rows of a CSVLogger file as a dict of columns (floats)."""
    cols = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                cols.setdefault(k, []).append(float(v) if v not in ("", "None") else float("nan"))
    return cols
