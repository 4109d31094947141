"""A worker that joins its process group and then waits forever: only its launcher's death can end it."""

import time

from shardtune.runtime import distributed


def main() -> None:
    distributed.init_worker()
    print("worker ready", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    distributed.worker_main(main)
