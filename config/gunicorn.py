"""The web server's layout, one definition for `dev.py up`, the benchmarks, the image and the
Kubernetes manifest: `gunicorn config.wsgi -c python:config.gunicorn`.

An API request is mostly Python on the CPU (PostgreSQL answers in a fraction of its time), and
the threads of one process take turns on the interpreter lock: the cores are filled with
processes, two per core, and four threads in each cover requests that wait (object storage,
Stripe, and a heartbeat's round trips to PostgreSQL: about 40 ms of wall time for 15 ms of
CPU). bench/scheduler.py on 2 cores (4 clients creating, from cold connections) found the
layouts within its noise of each other: 4 processes of 2 threads 204.9-214.7 creates/s, 2 of 4
211.7-212.3/s, 4 of 1 208.4/s. Half the threads may serve heartbeats
(AGENT_HEARTBEATS_IN_FLIGHT), half are kept for customers: with two threads, one heartbeat a
process, 1,000 simulated hosts at an 11 s interval were refused 1,845-2,479 times in a launch
run and a refused RUNNING report waited up to the interval (create -> RUNNING p99 4.2-11.7 s);
with four threads, two heartbeats a process: 1,794 refusals, p99 0.95 s; REST creates beside
1,000 busy hosts 61/s against 64-67/s (bench/launch.py, bench/scheduler.py, 2026-12-07).

Idle keep-alive connections are kept 75 s (WEB_KEEPALIVE_S), longer than the proxies and
clients in front keep theirs (nginx's upstream and AWS load balancers 60 s, aiohttp 15 s):
with gunicorn's 2 s, a client reusing a connection the server was closing at that instant lost
its request ("server disconnected"), and a POST is not retried. bench/marketplace.py at 10,000
nodes lost 2,606 of 6,000 creates that way when the web was busy. In gthread a kept connection
waits in the poller, not on a thread.

WEB_WORKERS and WEB_THREADS override both. In a container limited by a CPU quota, set
WEB_WORKERS to twice the pod's cores: the processor count seen here is the node's.
"""

import os

worker_class = "gthread"
workers = int(os.environ.get("WEB_WORKERS") or 2 * len(os.sched_getaffinity(0)))
threads = int(os.environ.get("WEB_THREADS") or 4)
keepalive = int(os.environ.get("WEB_KEEPALIVE_S") or 75)
