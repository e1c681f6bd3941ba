import pytest

from gpuworker.contract.placement import MAX_TENSOR_PARALLEL_SIZE, gpu_share_bytes, gpus_needed

GB = 10**9


@pytest.mark.parametrize(
    ("need", "gpu", "expected"),
    [
        (80 * GB, 80 * GB, 1),
        (80 * GB + 1, 80 * GB, 2),  # one byte over: two GPUs, half each
        (170 * GB, 80 * GB, 4),  # three would do, but heads split in powers of two
        (MAX_TENSOR_PARALLEL_SIZE * 80 * GB, 80 * GB, MAX_TENSOR_PARALLEL_SIZE),
        (MAX_TENSOR_PARALLEL_SIZE * 80 * GB + MAX_TENSOR_PARALLEL_SIZE, 80 * GB, None),
    ],
)
def test_gpus_needed_is_the_fewest_power_of_two_whose_shares_fit(need, gpu, expected):
    assert gpus_needed(need_bytes=need, gpu_bytes=gpu) == expected
    if expected is not None:
        assert gpu_share_bytes(need_bytes=need, tensor_parallel_size=expected) <= gpu
