"""The nanoGPT-shaped port (tests/nanogpt_port.py, written `import microtensor as torch`)
trained on tinyshakespeare-char twice: as written, and with its three import lines switched
to PyTorch. Same initial weights, same batches; prints both loss curves' evaluations and
writes them as JSON. The long run that issue "nanoGPT runs unmodified" asks for:

    python benchmarks/port_vs_torch.py --data ../shared/data/tinyshakespeare.txt \
        --max_iters 2000 --json out-bench/port_vs_torch.json
"""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a text file (character-level)")
    p.add_argument("--max_iters", type=int, default=2000)
    p.add_argument("--eval_interval", type=int, default=250)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the curves here")
    args = p.parse_args()
    if args.max_iters < 1 or args.eval_interval < 1 or args.threads < 1:
        p.error("--max_iters, --eval_interval and --threads must be positive")

    import microtensor as mt
    import torch
    from test_nanogpt_port import load_port, _params

    text = open(args.data, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    data = {"train": ids[:n], "val": ids[n:], "vocab_size": len(chars), "stoi": stoi}
    # nanoGPT's shakespeare_char CPU settings, dropout off
    shape = dict(block_size=64, n_layer=4, n_head=4, n_embd=128)
    mt.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    ours, theirs = load_port("microtensor"), load_port("torch")
    mt.manual_seed(0)
    init = _params(ours.GPT(ours.GPTConfig(vocab_size=data["vocab_size"], bias=True,
                                           dropout=0.0, **shape)))
    results = {}
    for name, port in (("microtensor", ours), ("torch", theirs)):
        cfg = port.default_config(out_dir=f"out-port-{name}", max_iters=args.max_iters,
                                  eval_interval=args.eval_interval, eval_iters=20,
                                  batch_size=12, learning_rate=1e-3, lr_decay_iters=args.max_iters,
                                  min_lr=1e-4, warmup_iters=100, **shape)
        t0 = time.time()
        _, log = port.train(data, cfg, model_state=init)
        results[name] = {"eval": log["eval"], "seconds": time.time() - t0}
        print(f"{name}: " + ", ".join(f"iter {s}: val {v:.4f}" for s, _, v in log["eval"]),
              f"({results[name]['seconds']:.0f} s)", flush=True)
    last = {k: r["eval"][-1][2] for k, r in results.items()}
    print(f"final val loss: microtensor {last['microtensor']:.4f}, torch {last['torch']:.4f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
