"""The placement engine: a snapshot of capacity in, decisions out. No Django, no database.

Inputs (`scheduler.engine.types`; times are epoch seconds as floats, money is `Decimal` per
GPU-hour):

- `Gpu`: one allocatable GPU. `model` is the catalog slug, `family` its family; `group` is its
  topology group on the node (GPUs sharing an NVLink island or PCIe switch), "" when it has none,
  in which case it is a group of its own.
- `Node`: a GPU server with its on-demand `price_per_gpu_hour`, the `min_bid` interruptible
  rentals must reach, `reliability` in [0, 1], its `gpus`, scheduler `pool`, whether its agent
  can give a rental SSH (`ssh_capable`), whether a rental may have the internet there
  (`internet_capable`), its `cluster` (nodes of one provider on one fabric; None for a node on
  its own), the image patterns its agent accepts (`image_allow`, None: any) and the images it
  holds (`images`).
- `Busy`: an allocation already bound, one per GPU, [start, end); only those ending after `now`
  matter. `interruptible` ones may be preempted; `price` is their locked price or bid.
- `Request`: a pending rental. A GPU matches when it satisfies every constraint given
  (`gpu_models`, `gpu_families`, `min_memory_gb`, `min_tensor_tflops`); a node matches when it
  is in the request's `pool` and `region` (None: any; "eu" also covers "eu-west") and its
  price suits: on-demand needs `price_per_gpu_hour <= max_price`, interruptible needs
  `min_bid <= bid <= max_price`; a request with `ssh` needs an `ssh_capable` node, one with
  `internet` an `internet_capable` node, one with an `image` a node whose allow-list admits it
  (agentprotocol.images). The request
  needs `gpus_per_node` matching GPUs on each of `node_count` distinct nodes (a gang: all or
  none, all its nodes in one cluster, none on a node without one), all in one topology group
  per node when `same_group`, for [start, start + duration)
  where start is `max(now, request.start)`, no later than `start_deadline`.
- `Snapshot(now, nodes, busy, pending)` and `Policy` (weights, aging, first fit, preemption,
  planning horizon, reservation depth, future-window candidates).

Output: `plan(snapshot, policy) -> Plan` with `placements` (GPUs and a locked price: the node's
on-demand price, the dearest node's for a gang, or the bid), `preemptions` (interruptible rentals
to stop; the caller frees all their remaining allocations), `waiting` and `expired` (each with a
reason for the customer) and `reservations` (where the first blocked requests are expected to
start; informational, never bound). `never_fits(request, nodes)` says why a request could not be
placed even on an idle cluster, for refusing it at create time.

Policies, in the order they apply:

1. Order: by effective priority `priority + aging_per_second * seconds waited` (so a low class
   gains one class per hour by default and is never starved), then FIFO by `created_at`, then
   rental id.
2. Filter: nodes whose pool, region, price and GPUs match (see above); a gang is searched in
   each cluster and takes the one whose nodes score best together (lowest total, then the
   lowest node id).
3. Score (lower is better, integer points, ties by node id): `pack_weight` per GPU of the node
   left free (idle now for a request starting now, free over the window for a later one: best
   fit, so whole nodes stay free for big requests),
   `topology_weight` per extra topology group spanned (one group preferred even when not
   required), `price_weight` per cent of the on-demand price, `reliability_weight` per 0.1 % of
   unreliability, `cold_weight` on a node that does not hold the request's image (it pulls it
   first; the default 1 point only breaks ties). `first_fit` drops all scoring: the lowest node
   id that fits, lowest GPU indices.
4. Time: every GPU holds a list of intervals, so a request may start in the future (placed on the
   window [start, start + duration) if it is free then, within `horizon`) and a short request may
   use GPUs reserved later if it ends before the reservation starts (backfill).
5. Backfill reservation: the first `reserve_depth` requests that cannot start are given, by a
   sweep over interval ends, the earliest time within `horizon` (and their deadline) at which
   they fit; their GPUs are held from then for the rest of the plan, so the requests behind them
   only backfill where they do not delay them.
6. Preemption (when `preemption`): an on-demand request starting now that fits nowhere may stop
   interruptible rentals; an interruptible request may stop interruptible rentals whose bid is
   strictly lower than its own. Never a rental of a higher priority class, never on-demand work,
   never work placed in this plan. On each node the victims are taken lowest bid first, then the
   one that started longest ago, and unnecessary ones are dropped; the nodes whose victims cost
   least (bid x GPUs) win. Nothing is preempted unless the whole request (every node of a gang)
   then fits.
7. Expiry: a request whose `start_deadline` has passed, or is reached in this cycle without a
   placement, is expired with a reason.

A GPU is never given to two overlapping intervals, existing allocations included, and never
twice in one plan.
"""

from scheduler.engine.feasibility import never_fits
from scheduler.engine.planner import DEFAULT_POLICY, effective_priority, plan
from scheduler.engine.types import (
    Busy,
    Expired,
    Gpu,
    Node,
    NodeGpus,
    Placement,
    Plan,
    Policy,
    Preemption,
    RentalId,
    Request,
    Reservation,
    Snapshot,
    Waiting,
)

__all__ = [
    "DEFAULT_POLICY",
    "Busy",
    "Expired",
    "Gpu",
    "Node",
    "NodeGpus",
    "Placement",
    "Plan",
    "Policy",
    "Preemption",
    "RentalId",
    "Request",
    "Reservation",
    "Snapshot",
    "Waiting",
    "effective_priority",
    "never_fits",
    "plan",
]
