"""What the tests and the benchmarks share.

Synthetic datasets, a loopback HTTP Range server, a loopback S3 server (moto), eviction
checks and child-process measurements.

Never imported by the runtime code of ``loader`` or ``sclayout`` (a test holds this).
"""
