"""Step stamps the audited workload appends to (bench/audit_overhead.py reads them)."""

STAMPS: list[float] = []
