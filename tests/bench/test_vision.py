"""bench/vision.py's parts on the CPU: no GPU busy share off CUDA, and the preprocessing rate of
one core."""


def test_the_busy_share_is_none_off_cuda(bench_script):
    vision = bench_script("vision")
    with vision.BusySampler("cpu") as sampler:
        pass
    assert sampler.samples == [] and sampler.busy is None


class _Recorded:
    """A PIL image that notes torch's intra-op threads each time the image processor converts it."""

    def __init__(self, image, threads: list[int]) -> None:
        self.image, self.threads = image, threads

    def convert(self, mode: str):
        import torch

        self.threads.append(torch.get_num_threads())
        return self.image.convert(mode)


def test_the_preprocessing_rate_is_one_cores_and_the_threads_come_back(bench_script, tmp_path):
    import torch

    from tests.gpuworker.models.vision_checkpoints import make_qwen2_5_vl

    vision = bench_script("vision")
    model = make_qwen2_5_vl(tmp_path)
    threads: list[int] = []
    images = [_Recorded(image, threads) for image in vision.noise_images(3, 64, seed=0)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert vision.preprocess_rate(str(model), images) > 0
        assert threads == [1] * 4 and torch.get_num_threads() == 2  # the warm-up and the 3 timed
    finally:
        torch.set_num_threads(before)
