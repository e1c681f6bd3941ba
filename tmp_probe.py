import time, numpy as np, torch, sys
sys.path.insert(0, "bench")
from common import DEFAULT_CONFIG
from gpuworker.engine import LLMEngine, SamplingParams
eng = LLMEngine(str(DEFAULT_CONFIG), device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=8,
                max_num_batched_tokens=2048, seed=0)
eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
r = eng.runner; g = r.decode_graphs; model = r.model
tables = np.arange(32, dtype=np.int32)[None, :]
args = dict(known_ids=np.array([-1]), placeholders=np.array([0]), sampled_rows=np.array([0]),
            positions=np.array([300]), slot_mapping=np.array([300]), seq_lens=np.array([301]), block_tables=tables)
side = torch.cuda.Stream()
def step(upload=True, d2h=True, side_d2h=False, greedy=True):
    if upload:
        g.inputs.upload(size=1, **args)
    g.graphs[1].replay()
    h = g.outputs[1][:1]
    if greedy:
        ids = model.greedy_tokens(h, out=g.sampled[:1])
    if d2h:
        host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        if side_d2h:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                host.copy_(ids, non_blocking=True); ev = torch.cuda.Event(); ev.record()
        else:
            host.copy_(ids, non_blocking=True); ev = torch.cuda.Event(); ev.record()
        return ev
def timeit(n=300, **kw):
    for _ in range(5): step(**kw)
    torch.cuda.synchronize(); t = time.perf_counter()
    evs = []
    for i in range(n):
        evs.append(step(**kw))
        if len(evs) > 2 and evs[-3] is not None: evs[-3].synchronize()  # host two steps ahead at most
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6
rows = []
for name, kw in [("full", {}), ("no d2h", dict(d2h=False)), ("no upload", dict(upload=False)),
                 ("neither", dict(upload=False, d2h=False)), ("side d2h", dict(side_d2h=True)),
                 ("graph only", dict(upload=False, d2h=False, greedy=False)), ("full again", {})]:
    rows.append((name, timeit(**kw)))
for name, us in rows: print(f"{name:12s} {us:8.1f} us/step")
