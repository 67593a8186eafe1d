"""The runner's step buffers. On CPU a StagedBuffer's host and device sides are one tensor, so the
copy that runs on CUDA is exercised here with a separate twin standing in for the device side."""

import torch

from micro_vllm.worker.model_runner import StagedBuffer


def _with_separate_twin(*shape: int) -> StagedBuffer:
    buffer = StagedBuffer(shape, torch.int32, torch.device("cpu"))
    buffer.device = torch.full(shape, -1, dtype=torch.int32)
    return buffer


def test_staged_buffer_copies_the_used_rows_of_a_vector():
    buffer = _with_separate_twin(8)
    buffer.np[:] = range(8)
    rows = buffer.copy_to_device(5)
    assert rows.tolist() == [0, 1, 2, 3, 4]
    assert buffer.device[5:].tolist() == [-1, -1, -1]  # rows past the step stay untouched


def test_staged_buffer_copies_only_the_used_columns_of_a_table():
    buffer = _with_separate_twin(4, 6)
    buffer.np[:] = torch.arange(24).reshape(4, 6).numpy()
    rows = buffer.copy_to_device(3, cols=2)
    assert rows.shape == (3, 6)
    assert rows[:, :2].tolist() == [[0, 1], [6, 7], [12, 13]]
    assert (rows[:, 2:] == -1).all() and (buffer.device[3] == -1).all()
