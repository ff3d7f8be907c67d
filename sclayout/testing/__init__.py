"""What the tests and the benchmarks share.

Synthetic datasets, a loopback HTTP Range server, loopback S3 (moto) and GCS servers,
eviction checks, child-process measurements and the targets of spawned test processes.

Never imported by the runtime code of ``loader`` or ``sclayout`` (a test holds this).
"""
