"""One engine's side of the speed gate: loads `engine` from a given source tree and times it on request.

    python quality_testing/speed_worker.py --root DIR --model GGUF --prefill N --ctx C --decode K --trials T

Run by path, never imported: `--root` goes first on sys.path, so `import engine` finds that
tree's engine (a checkout of another commit, or the working tree), and nothing else of this
repository is imported, so any commit's engine can be measured by the same code.
After loading it prints one JSON line {"ready": true, "load_s": ...}; then for every "run"
line on stdin it measures once and prints one JSON line, and it exits on "quit" or EOF:
  prefill  a fresh session syncs the first N ids of a fixed text's tokens: N / seconds
  decode   a fresh session holding C ids evaluates K tokens, each the argmax of the previous
           logits (session.eval): K / seconds; sampling policy is left out on purpose, it is
           not what the engine's speed is about
Each measurement is the best of T trials: contention from other processes only ever slows a
trial down, so the fastest one is the least noisy estimate of the engine's own speed.
A short untimed sync before the trials keeps one-off allocations out of the timings.
It only measures; the comparison and the verdict are gate_speed's.
"""
import argparse
import json
import sys
import time

TEXT = ("The harbour master counted the boats that came in with the evening tide, wrote each name in the "
        "ledger, and noted the weather, the catch and the state of the nets before the lamps were lit. ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefill", type=int, required=True)
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--decode", type=int, required=True)
    ap.add_argument("--trials", type=int, default=1)
    a = ap.parse_args()
    sys.path.insert(0, a.root)
    t0 = time.perf_counter()
    from engine import load_model

    need = max(a.prefill, a.ctx + a.decode) + 1
    model = load_model(a.model, ctx=need)
    ids: list = []
    while len(ids) < need:
        ids += model.tokenize(TEXT)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        model.new_session().sync(ids[:8])
        prefill = decode = 0.0
        for _ in range(max(1, a.trials)):
            s = model.new_session()
            t = time.perf_counter()
            s.sync(ids[: a.prefill])
            prefill = max(prefill, a.prefill / (time.perf_counter() - t))
            s = model.new_session()
            s.sync(ids[: a.ctx])
            t = time.perf_counter()
            for _ in range(a.decode):
                s.eval(int(s.logits.argmax()))
            decode = max(decode, a.decode / (time.perf_counter() - t))
        print(json.dumps({"prefill_tps": prefill, "decode_tps": decode}), flush=True)


if __name__ == "__main__":
    main()
