"""train.exit_duration_mins: the reserve a boundary must leave before the limit covers everything the run
does from that boundary to the end of a stop's save."""

from angelgpt.train.stop import RESERVE_FACTOR, RESERVE_MIN_S, reserve_s


def test_a_boundary_with_an_interval_save_reserves_that_save_the_next_iteration_and_the_final_save():
    # an interval save of 10 s at this boundary, then one more 3 s iteration, then the stop's 10 s save
    assert reserve_s(3.0, 10.0, 0.0, save_due=True, eval_due=False) == RESERVE_FACTOR * (10.0 + 3.0 + 10.0)
    assert reserve_s(3.0, 10.0, 0.0, save_due=False, eval_due=False) == RESERVE_FACTOR * (3.0 + 10.0)


def test_evaluation_is_reserved_for_the_stop_and_again_where_one_is_due():
    # a stop evaluates before its save; a boundary with an evaluation due evaluates before going on too
    assert reserve_s(3.0, 10.0, 4.0, save_due=False, eval_due=False) == RESERVE_FACTOR * (3.0 + 4.0 + 10.0)
    assert reserve_s(3.0, 10.0, 4.0, save_due=True, eval_due=True) == RESERVE_FACTOR * (14.0 + 3.0 + 14.0)


def test_a_tiny_run_reserves_at_least_the_minimum():
    assert reserve_s(0.01, 0.02, 0.0, save_due=True, eval_due=False) == RESERVE_MIN_S
