"""Which captured CUDA graph runs a decode batch: the smallest that fits, unless a larger
one replays faster (measured at capture; here given)."""
from workers.decode_graphs import pick_graph_sizes


def test_smallest_fitting_graph_by_default():
    times = {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.05, 16: 1.2}
    assert pick_graph_sizes(times) == [1, 1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8


def test_a_faster_larger_graph_wins_beyond_the_margin():
    # batch 1..4 run faster padded to 8 (e.g. cuBLAS's one-row kernels are slow); 16 is within 5% of 8
    times = {1: 1.5, 2: 1.5, 4: 1.45, 8: 1.33, 16: 1.3, 32: 2.0}
    pick = pick_graph_sizes(times)
    assert pick[1:5] == [8, 8, 8, 8]   # 1.33 beats 1.5 / 1.45 by more than 5%; 16 beats 8 by less
    assert pick[5:9] == [8] * 4 and pick[9:17] == [16] * 8 and pick[17:] == [32] * 16
    assert pick_graph_sizes(times, margin=0.0)[1] == 16


def test_piecewise_sizes_pad_little_and_are_multiples_of_16():
    """The token counts of the piecewise graphs: up to the step budget (rounded up to 16), every
    one a multiple of 16 (no Triton variant per size), at most an eighth of padding above 512."""
    from workers.piecewise_graphs import capture_sizes
    for budget in (200, 2048, 8192, 10000):
        sizes = capture_sizes(budget)
        assert sizes == sorted(set(sizes)) and sizes[0] == 16 and all(s % 16 == 0 for s in sizes)
        assert sizes[-1] == -(-budget // 16) * 16
        for small, large in zip(sizes, sizes[1:]):
            assert large <= 512 or large - small <= small / 8
