"""One hand-computed scenario per placement policy: exact nodes, GPUs, times and reasons."""

from __future__ import annotations

from decimal import Decimal

from enginekit import (
    HOUR,
    NOW,
    decide,
    make_busy,
    make_node,
    make_request,
    reason_of,
    snapshot,
)

from scheduler.engine import (
    Expired,
    Placement,
    Policy,
    Preemption,
    Reservation,
    effective_priority,
)

SPLIT = ["g0"] * 4 + ["g1"] * 4


def placed_on(result, rental_id):
    return next(p.nodes for p in result.placements if p.rental_id == rental_id)


# -- packing ------------------------------------------------------------------------------------


def test_packing_puts_two_gpus_on_the_node_with_two_free_not_the_empty_one():
    # given node 1 empty and node 2 with 6 of 8 GPUs busy
    snap = snapshot(
        [make_node(1), make_node(2)],
        make_busy(2, range(6), rental_id=900),
        [make_request(1, gpus_per_node=2)],
    )
    # then best fit fills node 2 and keeps node 1 whole
    assert placed_on(decide(snap), 1) == ((2, (206, 207)),)
    # and first fit takes the lowest node id
    assert placed_on(decide(snap, Policy(first_fit=True)), 1) == ((1, (100, 101)),)


# -- topology -----------------------------------------------------------------------------------


def test_topology_takes_a_whole_free_group_over_the_lowest_indices():
    # given groups g0 = 0..3 and g1 = 4..7, GPU 0 busy
    snap = snapshot(
        [make_node(1, groups=SPLIT)],
        make_busy(1, [0], rental_id=900),
        [make_request(1, gpus_per_node=4)],
    )
    assert placed_on(decide(snap), 1) == ((1, (104, 105, 106, 107)),)
    assert placed_on(decide(snap, Policy(first_fit=True)), 1) == ((1, (101, 102, 103, 104)),)


def test_same_group_required_goes_to_the_node_whose_group_holds_all_four():
    # given node 1 with 5 free GPUs split 2 + 3 and node 2 empty
    nodes = [make_node(1, groups=SPLIT), make_node(2, groups=SPLIT)]
    busy = make_busy(1, [0, 1, 4], rental_id=900)
    required = snapshot(nodes, busy, [make_request(1, gpus_per_node=4, same_group=True)])
    assert placed_on(decide(required), 1) == ((2, (200, 201, 202, 203)),)
    # when not required, packing wins and the GPUs span the fewest groups, largest first
    optional = snapshot(nodes, busy, [make_request(1, gpus_per_node=4)])
    assert placed_on(decide(optional), 1) == ((1, (102, 105, 106, 107)),)


def test_topology_is_preferred_over_one_gpu_of_packing_when_not_required():
    # given node 1 with 4 free split 2 + 2 and node 2 with 5 free, 4 of them in g1
    snap = snapshot(
        [make_node(1, groups=SPLIT), make_node(2, groups=SPLIT)],
        make_busy(1, [0, 1, 4, 5], rental_id=900) + make_busy(2, [0, 1, 2], rental_id=901),
        [make_request(1, gpus_per_node=4)],
    )
    assert placed_on(decide(snap), 1) == ((2, (204, 205, 206, 207)),)


# -- price and reliability ----------------------------------------------------------------------


def test_cheaper_node_wins_between_equal_fits():
    snap = snapshot(
        [make_node(1, price="2.00"), make_node(2, price="1.50")], pending=[make_request(1)]
    )
    result = decide(snap)
    assert result.placements == (
        Placement(
            rental_id=1,
            start=NOW,
            end=NOW + HOUR,
            price_per_gpu_hour=Decimal("1.50"),
            nodes=((2, (200,)),),
        ),
    )


def test_more_reliable_node_wins_at_the_same_price():
    snap = snapshot(
        [make_node(1, reliability=0.95), make_node(2, reliability=0.999)],
        pending=[make_request(1)],
    )
    assert placed_on(decide(snap), 1) == ((2, (200,)),)


def test_price_and_reliability_trade_off_by_their_weights():
    # node 1: 100 cents + 2 x 100 per-mille unreliability = 300 points;
    # node 2: 150 cents + 2 x 1 = 152 points
    snap = snapshot(
        [
            make_node(1, price="1.00", reliability=0.90),
            make_node(2, price="1.50", reliability=0.999),
        ],
        pending=[make_request(1)],
    )
    assert placed_on(decide(snap), 1) == ((2, (200,)),)


def test_equal_scores_break_ties_by_node_id():
    snap = snapshot([make_node(4), make_node(3)], pending=[make_request(1)])
    assert placed_on(decide(snap), 1) == ((3, (300,)),)


# -- order --------------------------------------------------------------------------------------


def test_priority_class_first_then_fifo_within_the_class():
    snap = snapshot(
        [make_node(1, gpus=1)],
        pending=[
            make_request(1, priority=0, created_at=NOW - 600),
            make_request(2, priority=1, created_at=NOW - 60),
            make_request(3, priority=1, created_at=NOW - 300),
        ],
    )
    result = decide(snap)
    assert [p.rental_id for p in result.placements] == [3]
    assert [w.rental_id for w in result.waiting] == [2, 1]


def test_aging_lets_a_long_waiting_low_class_overtake_a_fresh_higher_one():
    # one class per hour of waiting: 0 + 2 h > 1 + 1 min
    old = make_request(1, priority=0, created_at=NOW - 2 * HOUR)
    fresh = make_request(2, priority=1, created_at=NOW - 60)
    assert effective_priority(old, NOW) == 2.0
    result = decide(snapshot([make_node(1, gpus=1)], pending=[fresh, old]))
    assert [p.rental_id for p in result.placements] == [1]
    # without aging the class decides
    result = decide(
        snapshot([make_node(1, gpus=1)], pending=[fresh, old]), Policy(aging_per_second=0)
    )
    assert [p.rental_id for p in result.placements] == [2]


# -- time: future windows, backfill, reservations -----------------------------------------------


def test_future_start_is_placed_on_its_window_after_a_rental_ends():
    snap = snapshot(
        [make_node(1, gpus=1)],
        make_busy(1, [0], rental_id=900, start=NOW - HOUR, end=NOW + HOUR),
        [make_request(1, start=NOW + 2 * HOUR)],
    )
    assert decide(snap).placements == (
        Placement(
            rental_id=1,
            start=NOW + 2 * HOUR,
            end=NOW + 3 * HOUR,
            price_per_gpu_hour=Decimal("2.00"),
            nodes=((1, (100,)),),
        ),
    )


def test_future_start_avoids_a_node_booked_over_its_window():
    snap = snapshot(
        [make_node(1, gpus=1), make_node(2, gpus=1, price="3.00")],
        make_busy(1, [0], rental_id=900, start=NOW + HOUR, end=NOW + 5 * HOUR),
        [make_request(1, start=NOW + 2 * HOUR)],
    )
    assert placed_on(decide(snap), 1) == ((2, (200,)),)


def test_windows_may_touch_bookings_at_both_ends():
    # given one GPU running until +1 h and booked again over [+2 h, +3 h)
    booked = make_busy(1, [0], rental_id=900, start=NOW - HOUR, end=NOW + HOUR)
    booked += make_busy(1, [0], rental_id=901, start=NOW + 2 * HOUR, end=NOW + 3 * HOUR)
    snap = snapshot(
        [make_node(1, gpus=1)],
        booked,
        [
            make_request(1, start=NOW + HOUR, duration=HOUR, priority=1),
            make_request(2, start=NOW + 3 * HOUR, duration=HOUR),
        ],
    )
    # then [+1 h, +2 h) and [+3 h, +4 h) fit exactly around them
    assert [(p.rental_id, p.start) for p in decide(snap).placements] == [
        (1, NOW + HOUR),
        (2, NOW + 3 * HOUR),
    ]


def test_future_window_is_packed_onto_the_node_busiest_then():
    # given node 1 idle and node 2 with 6 GPUs busy through the window
    snap = snapshot(
        [make_node(1), make_node(2)],
        make_busy(2, range(6), rental_id=900, end=NOW + 9 * HOUR),
        [make_request(1, gpus_per_node=2, start=NOW + 2 * HOUR)],
    )
    assert placed_on(decide(snap), 1) == ((2, (206, 207)),)


def test_start_beyond_the_horizon_waits():
    snap = snapshot([make_node(1)], pending=[make_request(1, start=NOW + 72 * HOUR)])
    assert reason_of(decide(snap), 1) == (
        "start in the future: 2026-01-04T00:00:00Z is beyond the 48 h planning horizon"
    )


def test_short_request_backfills_before_a_future_placement_and_a_long_one_does_not():
    # given a booking of both GPUs from now + 2 h, decided first (higher class)
    snap = snapshot(
        [make_node(1, gpus=2)],
        pending=[
            make_request(1, gpus_per_node=2, start=NOW + 2 * HOUR, priority=1),
            make_request(2, gpus_per_node=2, duration=HOUR, created_at=NOW - 120),
            make_request(3, gpus_per_node=2, duration=3 * HOUR, created_at=NOW - 60),
        ],
    )
    result = decide(snap)
    assert [(p.rental_id, p.start, p.end) for p in result.placements] == [
        (1, NOW + 2 * HOUR, NOW + 3 * HOUR),
        (2, NOW, NOW + HOUR),
    ]
    assert reason_of(result, 3).startswith("no capacity: 1 nodes match, none has 2 free GPUs")


def test_blocked_head_request_is_reserved_and_only_harmless_backfill_passes():
    # given 2 of 8 GPUs busy until now + 2 h; request 1 (higher class) needs all 8
    snap = snapshot(
        [make_node(1)],
        make_busy(1, range(2), rental_id=900, end=NOW + 2 * HOUR),
        [
            make_request(1, gpus_per_node=8, duration=4 * HOUR, priority=1),
            make_request(2, gpus_per_node=2, duration=HOUR, created_at=NOW - 120),
            make_request(3, gpus_per_node=4, duration=3 * HOUR, created_at=NOW - 60),
        ],
    )
    result = decide(snap)
    # then request 1 is held from now + 2 h on all eight GPUs
    assert result.reservations == (
        Reservation(
            rental_id=1,
            start=NOW + 2 * HOUR,
            end=NOW + 6 * HOUR,
            nodes=((1, tuple(range(100, 108))),),
        ),
    )
    assert reason_of(result, 1) == (
        "no capacity: 1 nodes match, none has 8 free GPUs for 4 h; "
        "expected to start at 2026-01-01T02:00:00Z"
    )
    # and the 1 h request backfills, the 3 h one would delay request 1 and waits
    assert [(p.rental_id, p.nodes) for p in result.placements] == [(2, ((1, (102, 103)),))]
    assert reason_of(result, 3).startswith("no capacity")
    # without reservations the 3 h request is placed in the way
    greedy = decide(snap, Policy(reserve_depth=0))
    assert [(p.rental_id, p.nodes) for p in greedy.placements] == [
        (2, ((1, (102, 103)),)),
        (3, ((1, (104, 105, 106, 107)),)),
    ]
    assert greedy.reservations == ()


def test_reservation_fits_a_gap_exactly_as_long_as_the_request():
    # given one GPU running until +1 h and booked from +2 h
    booked = make_busy(1, [0], rental_id=900, start=NOW - HOUR, end=NOW + HOUR)
    booked += make_busy(1, [0], rental_id=901, start=NOW + 2 * HOUR, end=NOW + 5 * HOUR)
    snap = snapshot([make_node(1, gpus=1)], booked, [make_request(1, duration=HOUR)])
    assert [(r.start, r.end) for r in decide(snap).reservations] == [(NOW + HOUR, NOW + 2 * HOUR)]


def test_reservation_for_a_gang_waits_for_enough_nodes_at_once():
    # given node 1 busy until +1 h, node 2 busy until +3 h, node 3 free now but booked from +2 h
    snap = snapshot(
        [make_node(1, gpus=2), make_node(2, gpus=2), make_node(3, gpus=2)],
        make_busy(1, range(2), rental_id=901, end=NOW + HOUR)
        + make_busy(2, range(2), rental_id=902, end=NOW + 3 * HOUR)
        + make_busy(3, range(2), rental_id=903, start=NOW + 2 * HOUR, end=NOW + 9 * HOUR),
        [make_request(1, gpus_per_node=2, node_count=2, duration=2 * HOUR)],
    )
    # then the earliest time two nodes are free for 2 h together is +3 h (nodes 1 and 2)
    assert decide(snap).reservations == (
        Reservation(
            rental_id=1,
            start=NOW + 3 * HOUR,
            end=NOW + 5 * HOUR,
            nodes=((1, (100, 101)), (2, (200, 201))),
        ),
    )


# -- preemption ---------------------------------------------------------------------------------


def spot_node_busy():
    """Node 1: GPUs 0-1 interruptible at $1.00, 2-3 interruptible at $0.50, 4-7 on-demand."""
    return (
        make_busy(1, [0, 1], rental_id=901, interruptible=True, price="1.00")
        + make_busy(1, [2, 3], rental_id=902, interruptible=True, price="0.50")
        + make_busy(1, range(4, 8), rental_id=903)
    )


def test_on_demand_preempts_the_lowest_bid():
    snap = snapshot([make_node(1)], spot_node_busy(), [make_request(7, gpus_per_node=2)])
    result = decide(snap)
    assert result.preemptions == (
        Preemption(
            victim_rental_id=902, for_rental_id=7, reason="preempted for on-demand rental 7"
        ),
    )
    assert placed_on(result, 7) == ((1, (102, 103)),)


def test_equal_bids_preempt_the_one_that_started_longest_ago():
    busy = make_busy(1, [0, 1], rental_id=901, interruptible=True, price="0.50", start=NOW - 60)
    busy += make_busy(1, [2, 3], rental_id=902, interruptible=True, price="0.50", start=NOW - 600)
    busy += make_busy(1, range(4, 8), rental_id=903)
    result = decide(snapshot([make_node(1)], busy, [make_request(7, gpus_per_node=2)]))
    assert [p.victim_rental_id for p in result.preemptions] == [902]


def test_preemption_picks_the_node_with_the_cheapest_victims():
    # node 1: one 4-GPU victim at $0.50 (costs $2.00/h); node 2: one 1-GPU victim at $1.00
    busy = make_busy(1, range(4), rental_id=901, interruptible=True, price="0.50")
    busy += make_busy(1, range(4, 8), rental_id=903)
    busy += make_busy(2, [0], rental_id=902, interruptible=True, price="1.00")
    busy += make_busy(2, range(1, 8), rental_id=904)
    result = decide(snapshot([make_node(1), make_node(2)], busy, [make_request(7)]))
    assert [p.victim_rental_id for p in result.preemptions] == [902]
    assert placed_on(result, 7) == ((2, (200,)),)


def test_preemption_drops_a_cheap_victim_that_turned_out_unnecessary():
    # given g0 = 0..3 with a cheap victim on 0-1 and on-demand work on 2-3, and g1 = 4..7 held
    # by one dearer victim; a same-group request for 4 GPUs can only use g1
    busy = make_busy(1, [0, 1], rental_id=901, interruptible=True, price="0.20")
    busy += make_busy(1, [2, 3], rental_id=903)
    busy += make_busy(1, range(4, 8), rental_id=902, interruptible=True, price="0.80")
    snap = snapshot(
        [make_node(1, groups=SPLIT)], busy, [make_request(7, gpus_per_node=4, same_group=True)]
    )
    result = decide(snap)
    assert [p.victim_rental_id for p in result.preemptions] == [902]
    assert placed_on(result, 7) == ((1, (104, 105, 106, 107)),)


def test_no_preemption_when_freeing_every_victim_still_would_not_fit():
    snap = snapshot([make_node(1)], spot_node_busy(), [make_request(7, gpus_per_node=6)])
    result = decide(snap)
    assert result.preemptions == ()
    assert result.placements == ()
    assert reason_of(result, 7).startswith("no capacity: 1 nodes match, none has 6 free GPUs")


def test_no_preemption_when_one_node_of_the_gang_still_would_not_fit():
    snap = snapshot(
        [make_node(1), make_node(2)],
        spot_node_busy() + make_busy(2, range(8), rental_id=904),
        [make_request(7, gpus_per_node=4, node_count=2)],
    )
    result = decide(snap)
    assert (result.preemptions, result.placements) == ((), ())


def test_interruptible_outbids_only_lower_bids():
    outbid = snapshot(
        [make_node(1, min_bid="0.40")],
        spot_node_busy(),
        [make_request(7, gpus_per_node=2, interruptible=True, bid=Decimal("0.75"))],
    )
    result = decide(outbid)
    assert result.preemptions == (
        Preemption(
            victim_rental_id=902,
            for_rental_id=7,
            reason="outbid by rental 7: $0.75 > $0.50 per GPU-hour",
        ),
    )
    assert result.placements[0].price_per_gpu_hour == Decimal("0.75")
    too_low = snapshot(
        [make_node(1, min_bid="0.40")],
        spot_node_busy(),
        [make_request(7, gpus_per_node=2, interruptible=True, bid=Decimal("0.50"))],
    )
    assert decide(too_low).preemptions == ()
    # and a request that would need the higher bid's GPUs too stops nobody
    needs_both = snapshot(
        [make_node(1, min_bid="0.40")],
        spot_node_busy(),
        [make_request(7, gpus_per_node=4, interruptible=True, bid=Decimal("0.75"))],
    )
    assert decide(needs_both).preemptions == ()


def test_never_preempts_a_higher_class_or_when_preemption_is_off():
    busy = make_busy(1, range(8), rental_id=901, interruptible=True, price="0.10", priority=2)
    result = decide(snapshot([make_node(1)], busy, [make_request(7, priority=1)]))
    assert result.preemptions == ()
    cheap = make_busy(1, range(8), rental_id=901, interruptible=True, price="0.10")
    off = decide(snapshot([make_node(1)], cheap, [make_request(7)]), Policy(preemption=False))
    assert (off.preemptions, off.placements) == ((), ())


# -- gangs --------------------------------------------------------------------------------------


def test_gang_is_all_or_nothing():
    nodes = [make_node(1), make_node(2), make_node(3)]
    busy = make_busy(3, range(4), rental_id=900)
    three = decide(snapshot(nodes, busy, [make_request(1, gpus_per_node=8, node_count=3)]))
    assert three.placements == ()
    assert reason_of(three, 1).startswith(
        "no capacity: 3 nodes match, 2 have 8 free GPUs for 1 h, 3 needed"
    )
    two = decide(snapshot(nodes, busy, [make_request(1, gpus_per_node=8, node_count=2)]))
    assert placed_on(two, 1) == ((1, tuple(range(100, 108))), (2, tuple(range(200, 208))))


def test_gang_is_charged_its_dearest_node():
    snap = snapshot(
        [make_node(1, price="1.00"), make_node(2, price="1.20")],
        pending=[make_request(1, gpus_per_node=8, node_count=2)],
    )
    assert decide(snap).placements[0].price_per_gpu_hour == Decimal("1.20")


# -- expiry and reasons -------------------------------------------------------------------------


def test_deadline_passed_expires_without_trying():
    snap = snapshot([make_node(1)], pending=[make_request(1, start_deadline=NOW - 1)])
    assert decide(snap).expired == (
        Expired(
            rental_id=1, reason="start deadline 2025-12-31T23:59:59Z passed without a placement"
        ),
    )


def test_deadline_reached_without_capacity_expires_and_a_later_one_waits():
    busy = make_busy(1, range(8), rental_id=900)
    now_due = decide(snapshot([make_node(1)], busy, [make_request(1, start_deadline=NOW)]))
    assert now_due.expired == (
        Expired(
            rental_id=1,
            reason="start deadline 2026-01-01T00:00:00Z reached without a placement: "
            "no capacity: 1 nodes match, none has 1 free GPUs for 1 h",
        ),
    )
    later = decide(snapshot([make_node(1)], busy, [make_request(1, start_deadline=NOW + 60)]))
    assert [w.rental_id for w in later.waiting] == [1]


def test_reason_names_the_price_gap():
    snap = snapshot(
        [make_node(1, price="2.10"), make_node(2, price="2.50")],
        pending=[make_request(1, max_price=Decimal("2.00"))],
    )
    assert reason_of(decide(snap), 1) == "price: cheapest matching node is $2.10 > max $2.00"


def test_reason_names_the_topology_shortfall():
    nodes = [make_node(i, groups=SPLIT) for i in (1, 2, 3)]
    snap = snapshot(nodes, pending=[make_request(1, gpus_per_node=8, same_group=True)])
    assert reason_of(decide(snap), 1) == (
        "no node in pool default has 8 matching GPUs in one topology group"
    )
    busy = make_busy(1, [0], rental_id=900) + make_busy(2, [0], rental_id=901)
    busy += make_busy(3, [0], rental_id=902)
    snap = snapshot(
        [make_node(i) for i in (1, 2, 3)],
        busy,
        [make_request(1, gpus_per_node=8, same_group=True)],
    )
    assert reason_of(decide(snap, Policy(reserve_depth=0)), 1) == (
        "no capacity: 3 nodes match, none has 8 free GPUs in one topology group for 1 h"
    )


def test_region_matches_itself_and_its_subregions_only():
    snap = snapshot(
        [make_node(1, region="us-east"), make_node(2, region="eu-west"), make_node(3)],
        pending=[make_request(1, region="eu", gpus_per_node=8, node_count=2)],
    )
    assert [n for n, _ in placed_on(decide(snap), 1)] == [2, 3]
    snap = snapshot([make_node(1, region="europe")], pending=[make_request(1, region="eu")])
    assert reason_of(decide(snap), 1).startswith("no node in region eu (pool default)")
