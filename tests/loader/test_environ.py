"""No loader call changes ``os.environ``: opening, reading an epoch and closing local
stores (decoding in threads and in decode processes), a store served over HTTP and one
in an S3 bucket leave every variable as it was, while tensorstore's HTTP transport
still has its stall watchdog (which it reads only from the environment)."""

from __future__ import annotations

import importlib.util
import json
import os

SCRIPT = """
import json, os, socket, sys, threading
import numpy as np
from sclayout.testing.httpserver import serve_directory

store, folder, n_obs = sys.argv[1], sys.argv[2], int(sys.argv[3])
s3 = None
if sys.argv[4] == "s3":
    from sclayout.testing.s3server import serve_s3
    serving = serve_s3(buckets=("data",))  # kept: the server stops when it is collected
    s3 = serving.__enter__()
    os.environ.update(s3.variables())  # the caller's settings, before the snapshot
before = dict(os.environ)

import loader
from loader import BlockDataset, open_layout
from loader.backends import TensorstoreSettings
from loader.engine import EngineConfig, buffers
from loader.engine.engine import running
from loader.errors import ReadError

buffers.MIN_BYTES = 0  # every fetch array shared: decode processes decode them all
TensorstoreSettings.HTTP_STALL_SECONDS = 2  # the watchdog the first transport gets
report = {}

def epoch(where, **options):
    reader = open_layout(where, **options)
    with BlockDataset(reader, batch_size=16, output="csr") as ds:
        rows = np.concatenate([b["index"].numpy() for b in ds])
        assert sorted(rows.tolist()) == list(range(n_obs)), where
    reader.close()  # a reader passed to a dataset is the caller's to close
    return len(rows)

# a server that accepts and never answers: only the stall watchdog ends the read
silent = socket.create_server(("127.0.0.1", 0))
held = []
threading.Thread(target=lambda: [held.append(silent.accept()) for _ in iter(int, 1)],
                 daemon=True).start()
try:
    open_layout(f"http://127.0.0.1:{silent.getsockname()[1]}/s.zarr", http_retries=0,
                http_timeout=60)
    report["stalled"] = "opened"
except ReadError as e:
    report["stalled"] = str(e)
for mode in ("threads", "processes"):
    report[mode] = epoch(store, engine=EngineConfig(mode=mode, threads=2))
    report[mode + " decoders held"] = [d.leases for d in running()]
with serve_directory(folder) as server:
    report["http"] = epoch(server.url_for(os.path.basename(store)))
if s3 is not None:
    import boto3  # comes with moto
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for root, _, files in os.walk(store):
        for name in files:
            path = os.path.join(root, name)
            client.upload_file(path, "data", "s.zarr/" + os.path.relpath(path, store))
    report["s3"] = epoch("s3://data/s.zarr")
after = dict(os.environ)
report["changed"] = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
print(json.dumps(report))
"""


def test_no_loader_call_changes_the_environment(stores, stores_n_obs, run_python):
    store = str(stores["shuffled"])
    s3 = "s3" if importlib.util.find_spec("moto") else "none"
    parent = os.path.dirname(store)
    out = run_python(SCRIPT, store, parent, str(stores_n_obs), s3, timeout=240)
    report = json.loads(out.splitlines()[-1])
    assert report["changed"] == [], report  # not one variable added, removed or changed
    for kind in ["threads", "processes", "http"] + (["s3"] if s3 == "s3" else []):
        assert report[kind] == stores_n_obs, kind  # every row once, read there
    # closed readers hold no decoders (idle ones stop a moment later)
    assert set(report["threads decoders held"] + report["processes decoders held"]) <= {0}
    # the watchdog, set only while tensorstore made its HTTP transport, still ends a
    # request that receives nothing
    assert "too slow" in report["stalled"].lower(), report["stalled"]
