"""A job whose ranks are threads of one process, with a stand-in for the collectives (a
threading.Barrier) that records each rank's calls: enough for code that talks to its peers
only through trainer.distributed's collectives, such as trainer/checkpoint.py's
CheckpointManager, to be run as every rank at once and seen from each."""
import threading


class ThreadRank:
    """One rank of a job whose ranks are threads of this process; records its collectives."""

    def __init__(self, job: "ThreadJob", rank: int):
        self.job, self.rank, self.calls = job, rank, []

    @property
    def world_size(self) -> int:
        return self.job.world_size

    def barrier(self):
        self.calls.append("barrier")
        self.job.barrier.wait(timeout=30)

    def broadcast(self, obj):
        self.calls.append("broadcast")
        return self.all_gather_raw(obj)[0]

    def all_gather(self, obj) -> list:
        self.calls.append("all_gather")
        return self.all_gather_raw(obj)

    def agree(self, problem):
        return next((p for p in self.all_gather(problem) if p), None)

    def all_gather_raw(self, obj) -> list:
        self.job.slots[self.rank] = obj
        self.job.barrier.wait(timeout=30)
        gathered = [self.job.slots[r] for r in range(self.world_size)]
        self.job.barrier.wait(timeout=30)
        return gathered


class ThreadJob:
    def __init__(self, world_size: int):
        self.world_size, self.barrier, self.slots = world_size, threading.Barrier(world_size), {}

    def run(self, fn) -> list:
        """fn(rank: ThreadRank) on every rank at once; each rank's (ThreadRank, result or exception)."""
        ranks = [ThreadRank(self, r) for r in range(self.world_size)]
        results = [None] * self.world_size

        def call(r):
            try:
                results[r] = fn(ranks[r])
            except BaseException as exc:  # noqa: BLE001  shown to the test (a rank left behind times out)
                results[r] = exc
        threads = [threading.Thread(target=call, args=(r,), name=f"rank{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return list(zip(ranks, results))
