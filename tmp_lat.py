import sys, random, argparse
sys.path.insert(0, "bench")
import torch
from common import DEFAULT_CONFIG, load_hf_config, copy_bandwidth_gbs
import latency
from gpuworker.kernels import gemv as G
args = argparse.Namespace(config=DEFAULT_CONFIG, dtype="bfloat16", output_len=512, repeats=3)
cfg = load_hf_config(DEFAULT_CONFIG)
rng = random.Random(0)
prompt = [rng.randrange(cfg["vocab_size"]) for _ in range(128)]
print("copy GB/s", copy_bandwidth_gbs())
for name in sys.argv[1:]:
    G.TUNED[(4096, 4096)] = {1: name}
    r = latency.engine_decode_rate(args, prompt)
    print(f"o_proj {name:28s} {r['decode_tok_s']:.1f} tok/s")
