"""What a wandb run wrote to its local file (run-<id>.wandb), read back for the tests: the
LevelDB log format wandb keeps (a 7-byte header, then 32 KiB blocks of records, each a 7-byte
header of checksum, length and kind, a record longer than its block cut into pieces) holding
wandb's protobuf Records."""
import struct
import time
from pathlib import Path

HEADER, BLOCK, PIECE = 7, 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path, wait_s: float = 30) -> list:
    """The run's records, once the file holds its exit record: wandb's service process writes the
    file, and may still be writing when a run in the test's own process has returned from finish()."""
    deadline = time.monotonic() + wait_s
    while True:
        found = _read(path)
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _read(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    out, pos, pending = [], HEADER, b""
    while pos + PIECE <= len(data):
        if BLOCK - pos % BLOCK < PIECE:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + PIECE])
        if kind == 0:
            break
        pending += data[pos + PIECE:pos + PIECE + length]
        pos += PIECE + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history_rows(path: Path) -> list[dict]:
    """Each logged row as {key: value}, with wandb's own "_step"."""
    import json

    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def step_metrics(path: Path) -> dict:
    """{metric name or glob: the metric it is plotted against} from the run's define_metric calls."""
    return {r.metric.name or r.metric.glob_name: r.metric.step_metric for r in records(path)
            if r.WhichOneof("record_type") == "metric"}
