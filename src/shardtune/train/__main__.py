from shardtune.runtime.distributed import worker_main
from shardtune.train.recipe import main

worker_main(main)
