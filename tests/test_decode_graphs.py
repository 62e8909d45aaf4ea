"""Decode CUDA graphs on the host side: which captured graph runs a decode batch (the smallest
that fits, unless a larger one replays faster: measured at capture, here given), and the
staging buffer a step's inputs reach the graph through."""
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


def test_staged_fields_read_back_through_the_graphs_device_views():
    """What the host writes into a decode graph's staging buffer (numpy views) is what the
    graph reads (torch views of the same bytes): B rows, padding rows past them (no KV write,
    one key of context, their own launch order, greedy), the block table packed at its width."""
    import numpy as np
    import torch
    from workers.decode_graphs import StagingLayout, write_staged
    from workers.sampler import SamplingArrays
    from workers.step_inputs import StepArrays
    for mrope in (False, True):
        layout = StagingLayout.build(4, mrope)
        buf = np.full(layout.table_offset + 4 * 4 * 16, 0x55, np.uint8)
        positions = np.array([[7, 9]] * 3) if mrope else np.array([7, 9])
        # the sampler's fields other than temperature and seeds: their padding values
        sampling = SamplingArrays(temperature=np.array([0.5, 0.0], np.float32), top_k=np.zeros(2, np.int32),
                                  top_p=np.ones(2, np.float32), min_p=np.zeros(2, np.float32),
                                  seeds=np.array([11, 12]), output_indices=np.zeros(2, np.int64),
                                  slots=np.zeros(2, np.int64))
        host = StepArrays(input_ids=np.array([3, 4]), positions=positions, slot_mapping=np.array([70, 91]),
                          query_start_loc=np.array([0, 1, 2], np.int32), seq_lens=np.array([8, 10], np.int32),
                          decode_order=np.array([1, 0], np.int32),
                          block_table=np.array([[5, 6, 0], [1, 2, 3]], np.int32), sampling=sampling)
        rows, nbytes = write_staged(layout.views(buf), layout, host)
        dev = layout.views(torch.from_numpy(buf))
        assert rows == 2 and nbytes == layout.table_offset + 4 * 4 * 3
        assert dev["input_ids"].tolist() == [3, 4, 0, 0] and dev["slot_mapping"].tolist() == [70, 91, -1, -1]
        assert dev["positions"].tolist() == ([[7, 9, 0, 0]] * 3 if mrope else [7, 9, 0, 0])
        assert dev["seq_lens"].tolist() == [8, 10, 1, 1] and dev["decode_order"].tolist() == [1, 0, 2, 3]
        assert dev["temperature"].tolist() == [0.5, 0.0, 0.0, 0.0] and dev["top_p"].tolist() == [1.0] * 4
        assert dev["graph_feed_rows"].tolist() == [-1] * 4 and dev["seeds"].tolist() == [11, 12, 0, 0]
        assert dev["table_width"].tolist() == [3]
        assert dev["block_table"][:12].view(4, 3).tolist() == [[5, 6, 0], [1, 2, 3], [0, 0, 0], [0, 0, 0]]


def test_feed_indices_for_a_decode_graph_and_for_eager_steps():
    """Rows whose input is the token the previous step samples (still on the device): a decode
    graph after a step its head sampled reads them itself (graph_feed_rows: the row in that step's
    tokens, -1 for none); any other step copies them (token index, row in the previous tokens)."""
    import numpy as np
    from workers.input_batch import CachedRequestState
    from workers.model_runner import PendingStep
    from workers.step_inputs import feed_indices
    st = [CachedRequestState(f"r{i}", i, 4, 6, 5, 1, None, 0, []) for i in range(3)]
    # prev sampled r2 then r0 (rows 0, 1 of its tokens); r1 is mid-prompt there, not sampled
    prev = PendingStep(["r2", "r1", "r0"], [st[2], st[1], st[0]], np.array([0, 2]))
    start = np.array([6, 5, 6])  # r0 and r2 are at their last known token + 1: prev's token is their input
    qsl = np.array([0, 1, 2, 3])
    eager = feed_indices(prev, st, start, qsl, decode_graph=False)
    assert eager.fed_token_index.tolist() == [0, 2] and eager.fed_from_rows.tolist() == [1, 0]
    prev.graph_sampled = True
    assert feed_indices(prev, st, start, qsl, decode_graph=True).graph_feed_rows.tolist() == [1, -1, 0]
    prev.graph_sampled = False  # a decode graph after an eagerly sampled step copies, as eager steps do
    copied = feed_indices(prev, st, start, qsl, decode_graph=True)
    assert copied.graph_feed_rows is None and copied.fed_token_index is not None and copied.fed_from_rows is not None
    assert feed_indices(prev, st, np.array([5, 5, 5]), qsl, decode_graph=False) is None


def test_which_rows_the_graph_head_samples():
    """The head samples greedy, temperature and min-p rows (top-k off: 0, -1 or >= the
    vocabulary), and top-p rows where the logits are whole (not a TP shard); top-k, logprobs,
    penalties, logit_bias and min_tokens rows sample eagerly."""
    from ipc.sampling_params import SamplingParams
    from workers.sampler import Sampler, SamplingRow
    def plain(**kw):
        return Sampler.plain([SamplingRow(SamplingParams(**kw), 0, 0, 0, (2,))], vocab=100)
    assert plain(temperature=0) and plain(temperature=0.7, min_p=0.1)
    assert plain(temperature=0.7, top_k=-1) and plain(temperature=0.7, top_k=100)
    for kw in ({"top_k": 20}, {"top_p": 0.9}, {"logprobs": 0}, {"presence_penalty": 0.5},
               {"repetition_penalty": 1.1}, {"logit_bias": {3: 1.0}}, {"min_tokens": 2}):
        assert not plain(temperature=0.7, **kw), kw
    # where the logits are whole (no TP shard), top-p without top-k samples in the head too
    def whole(**kw):
        return Sampler.plain([SamplingRow(SamplingParams(**kw), 0, 0, 0, (2,))], vocab=100, top_p=True)
    assert whole(temperature=0.7, top_p=0.9) and whole(temperature=0.7, top_p=0.9, top_k=100)
    assert not whole(temperature=0.7, top_p=0.9, top_k=20) and not whole(temperature=0.7, top_p=0.9,
                                                                          presence_penalty=0.5)


def test_which_rows_the_penalty_head_samples():
    """The penalty head takes head rows plus repetition / presence / frequency penalties (some row
    must have them); logit_bias, min_tokens, allowed_token_ids, top-k and logprobs stay eager."""
    from ipc.sampling_params import SamplingParams
    from workers.sampler import Sampler, SamplingRow
    def head(*kws):
        return Sampler.penalties_only([SamplingRow(SamplingParams(**kw), 0, 0, 0, (2,)) for kw in kws], vocab=100)
    pen = dict(temperature=0.7, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5)
    assert head(pen) and head(pen, dict(temperature=0.7)) and head(dict(temperature=0, frequency_penalty=0.2))
    assert not head(dict(temperature=0.7, top_p=0.9))   # no penalties: the plain head
    for kw in ({"top_k": 20}, {"logprobs": 0}, {"logit_bias": {3: 1.0}}, {"min_tokens": 2},
               {"allowed_token_ids": [1, 2]}):
        assert not head({**pen, **kw}) and not head(pen, dict(temperature=0.7, **kw)), kw
