#!/usr/bin/env bash
# Start N prefill workers on this host.
#   scripts/launch_prefill.sh [-n N] [-p BASE_PORT] [-H BIND_ADDR] [-d RUN_DIR] [-w SECONDS]
#                             [--secrets DIR | --api-key-file FILE --kv-keys DIR] [--dry-run]
#                             [--tensor-parallel-size T] [--devices GROUPS]
#                             [-- extra `python -m proserve.prefill` flags]
# Worker i serves HTTP on BIND_ADDR:BASE_PORT+i (default 127.0.0.1:8100+i, loopback).
# Another host's dispatcher reaching it needs -H (this host's address, or 0.0.0.0), and a
# non-loopback -H needs the API key the dispatcher sends (--api-key-file FILE; the worker
# refuses to start without one unless given '-- --allow-no-api-key'). --kv-keys DIR: the CURVE
# keys it pushes KV with (a prefill host needs DIR/client.key_secret and DIR/server.key).
# --secrets DIR: both from scripts/make_keys.sh's layout (DIR/worker.key, DIR/kv).
# -w SECONDS: wait (at most that long) until every worker answers /health; default: don't.
# --tensor-parallel-size T (or --tp T, default 1): ranks per worker. --devices GROUPS: one group per
# worker separated by ':' (e.g. 0,1:2,3): with the worker flag --device cuda T GPUs (CUDA_VISIBLE_DEVICES),
# npu T NPUs (ASCEND_RT_VISIBLE_DEVICES), cpu (the default) a multiple of T cores, an equal share per rank
# (VLLM_CPU_OMP_THREADS_BIND). Default: GPU/NPU worker i gets devices i*T..i*T+T-1; CPU workers with T > 1
# get disjoint cores if there are enough, else each worker's ranks split all cores; T = 1 on CPU is left
# to vLLM (or -- --cpu-bind). Two pools on one host: give --devices so that they do not overlap.
# --dry-run: print the worker command lines, each after the variables it is started with; start nothing.
# Logs go to RUN_DIR/prefill-i.log and PIDs to RUN_DIR/pids (default RUN_DIR: ./run);
# scripts/stop_pool.sh [-d RUN_DIR] stops them.
exec "$(dirname "$0")/_launch_pool.sh" prefill 8100 "$@"
