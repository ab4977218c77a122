"""The web server's layout, one definition for `dev.py up`, the benchmarks, the image and the
Kubernetes manifest: `gunicorn config.wsgi -c python:config.gunicorn`.

An API request is CPU-bound Python (PostgreSQL answers in a fraction of its time), and a process
runs Python on one core at a time, so the cores are used by processes, two per core; two threads
in each cover a request that waits (object storage, Stripe). More threads only queue on the
interpreter lock: on 2 cores, API creates from 4 clients ran at 256/s with 4 processes of 1
thread, 241/s with 4 of 2, and 216-221/s with 2 of 4 (bench/scheduler.py, the same minutes).

WEB_WORKERS and WEB_THREADS override both. In a container limited by a CPU quota, set
WEB_WORKERS to twice the pod's cores: the processor count seen here is the node's.
"""

import os

worker_class = "gthread"
workers = int(os.environ.get("WEB_WORKERS") or 2 * len(os.sched_getaffinity(0)))
threads = int(os.environ.get("WEB_THREADS") or 2)
