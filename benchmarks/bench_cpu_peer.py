"""pyengine vs llama.cpp (llama-cpp-python) on the CPU: the same GGUF, the same token ids, greedy.

llama-cpp-python is not a test dependency. Install it from PyPI (it compiles llama.cpp from source
for this CPU, several minutes; one compile job keeps a shared machine usable):

    CMAKE_BUILD_PARALLEL_LEVEL=1 pip install llama-cpp-python==0.3.36

Each measurement runs in a fresh process (its own load time and peak RSS, from wait4), the two
engines taking turns: pyengine, llama.cpp, pyengine, llama.cpp, ... for every thread count, so a
burst of load from other processes on a shared machine hits both alike. Per process:
  load_s       model load to ready (pyengine: LLM(); llama.cpp: Llama())
  pp_tok_s     prompt processing: --prompt-tokens tokens / time of (prompt + 1 generated token)
  decode_tok_s --max-tokens / (time(prompt + 1 + max_tokens tokens) - time(prompt + 1 token)),
               short chat prompt, plain greedy (pyengine: no speculation, no prefix caching;
               llama.cpp: reset() before each generate, so no KV reuse either)
  spec_tok_s   the same with prompt-lookup speculation, k = --spec-tokens, on a grounded prompt
               (an answer that copies from the prompt): pyengine's ngram proposer, llama.cpp's
               LlamaPromptLookupDecoding(num_pred_tokens=k); plain_tok_s is that prompt without it
  peak_rss_mb  the process's maximum resident set (load + all of the above)
Rates are the best of --repeats after a warm-up. Medians over --rounds processes go to the JSON
with /proc/loadavg before and after each process (the machine is shared: see the note).
--arith default int16 exact int8 runs pyengine once per arithmetic of the GGUF linears (its
KernelConfig: the default; cpu_int16_dot, two int16 limbs; the exact fp32 products; cpu_int8_dot,
llama.cpp's), all taking turns with llama.cpp in each round; keys then read pyengine_<arith>_...

    python benchmarks/bench_cpu_peer.py [--threads 1 2] [--rounds 3] [--max-tokens 128] [--arith ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load import loadavg, machine, run_child  # noqa: E402
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "cpu_peer.json")

CHAT = "What is the capital of France? Answer in two sentences."
GROUNDED = ("Here is a function:\n\ndef moving_average(values, window):\n    result = []\n"
            "    for i in range(len(values) - window + 1):\n        chunk = values[i:i + window]\n"
            "        result.append(sum(chunk) / window)\n    return result\n\n"
            "Rewrite this function exactly, but rename it to rolling_mean and add a docstring.")
FILLER = ("The history of science is the study of the development of science and scientific knowledge, "
          "including both the natural and social sciences. ")

CHILD = r"""
import json, sys, time
engine, threads, spec_k, max_tokens, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
kernel_config = json.loads(sys.argv[6])
ids = json.loads(sys.stdin.read())
model = ids.pop("model")
out = {}

def best(fn):
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter(); r = fn(); t = min(t, time.perf_counter() - t0)
    return t, r

if engine == "pyengine":
    import torch
    torch.set_num_threads(threads)
    from pyengine import LLM, SamplingParams
    spec = {"method": "ngram", "num_speculative_tokens": spec_k} if spec_k else None
    t0 = time.perf_counter()
    llm = LLM(model, enable_prefix_caching=False, speculative_config=spec, kernel_config=kernel_config)
    out["load_s"] = time.perf_counter() - t0
    def gen(prompt, n):
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return list(llm.run_requests([(None, prompt)], [p])[0].output_token_ids)
else:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
                verbose=False, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=spec_k) if spec_k else None)
    out["load_s"] = time.perf_counter() - t0
    def gen(prompt, n):
        llm.reset()  # no KV reuse from the previous run (pyengine runs without prefix caching)
        toks = []
        for t in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            toks.append(t)
            if len(toks) == n:
                break
        return toks

def rate(prompt, key):
    gen(prompt, 2)  # warm-up
    t1, _ = best(lambda: gen(prompt, 1))
    tn, toks = best(lambda: gen(prompt, 1 + max_tokens))
    out[key] = max_tokens / (tn - t1)
    out[key.replace("_tok_s", "_tokens")] = toks

if spec_k:
    rate(ids["grounded"], "spec_tok_s")
else:
    gen(ids["long"][:32], 1)
    t, _ = best(lambda: gen(ids["long"], 1))
    out["pp_tok_s"] = len(ids["long"]) / t
    rate(ids["chat"], "decode_tok_s")
    rate(ids["grounded"], "plain_tok_s")
print(json.dumps(out))
"""


ARITH = {"default": {}, "int16": {"cpu_int16_dot": True, "cpu_int8_dot": False},
         "exact": {"cpu_int16_dot": False, "cpu_int8_dot": False}, "int8": {"cpu_int8_dot": True}}


def run_engine(engine: str, threads: int, spec_k: int, ids: dict[str, Any], args: argparse.Namespace,
               arith: str = "default") -> dict[str, Any]:
    """One fresh process (bench_load.run_child): its result, peak RSS and the load around it."""
    before = loadavg()
    argv = ["-c", CHILD, engine, str(threads), str(spec_k), str(args.max_tokens), str(args.repeats),
            json.dumps(ARITH[arith])]
    env = dict(os.environ, PYTHONPATH=ROOT)  # the child sets torch's threads; the pool follows them
    result, _, peak_rss_mb = run_child(argv, json.dumps(ids).encode(), env, ROOT)
    result["loadavg"] = [before, loadavg()]
    result["peak_rss_mb"] = round(peak_rss_mb, 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3, help="processes per engine, thread count and mode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--int8-dot", action="store_true",
                    help="pyengine with KernelConfig.cpu_int8_dot: llama.cpp's arithmetic for the GGUF linears")
    ap.add_argument("--arith", nargs="+", choices=sorted(ARITH), default=None,
                    help="pyengine once per arithmetic of the GGUF linears, in turns (keys pyengine_<arith>_...)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    arith = args.arith or ["int8" if args.int8_dot else "default"]
    pyengines = {"pyengine": arith[0]} if len(arith) == 1 else {f"pyengine_{a}": a for a in arith}
    engines = [*pyengines, "llama.cpp"]
    spec_ks = (0, args.spec_tokens) if args.spec_tokens else (0,)  # --spec-tokens 0: no speculation runs
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed; see this script's docstring") from None
    from pyengine.loader import default_model_path
    from pyengine.loader.gguf_file import _open, read_fields
    from pyengine.tokenizer import Tokenizer

    model = default_model_path()
    tok = Tokenizer.from_gguf_fields(read_fields(_open(model)))
    chat = lambda text: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),  # noqa: E731
                                   add_special_tokens=False)
    filler = tok.encode(FILLER * (args.prompt_tokens // 10 + 1))
    ids = {"model": model, "chat": chat(CHAT), "grounded": chat(GROUNDED), "long": filler[:args.prompt_tokens]}
    started, date = loadavg(), datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for threads in args.threads:
            for spec_k in spec_ks:
                for engine in engines:  # taking turns
                    res = run_engine("llama.cpp" if engine == "llama.cpp" else "pyengine", threads, spec_k, ids, args,
                                     pyengines.get(engine, "default"))
                    runs.setdefault(f"{engine}|{threads}|{spec_k}", []).append(res)
                    shown = {k: round(v, 2) for k, v in res.items() if isinstance(v, float)}
                    print(f"round {r + 1} {engine} threads={threads} spec={spec_k}: {shown} load {res['loadavg'][0]}",
                          file=sys.stderr, flush=True)
    rows = []
    for threads in args.threads:
        row: dict[str, Any] = {"threads": threads}
        for engine in engines:
            for spec_k in spec_ks:
                for key, value in _medians(runs[f"{engine}|{threads}|{spec_k}"]).items():
                    if not spec_k or key.startswith("spec_"):  # load time and RSS: the plain process's
                        row[f"{engine}_{key}"] = value
        for engine in pyengines:
            tag = engine[len("pyengine"):]
            for key in ("decode_tok_s", "pp_tok_s", "plain_tok_s") + (("spec_tok_s",) if args.spec_tokens else ()):
                row[f"ratio{tag}_{key}"] = round(row[f"{engine}_{key}"] / row[f"llama.cpp_{key}"], 3)
            first = {e: runs[f"{e}|{threads}|0"][0] for e in (engine, "llama.cpp")}
            for key, name in (("decode_tokens", "decode"), ("plain_tokens", "grounded")):
                row[f"same_greedy_tokens{tag}_{name}"] = first[engine][key] == first["llama.cpp"][key]
        rows.append(row)
    result = {
        "benchmark": "pyengine vs llama-cpp-python " + llama_cpp.__version__ + ", same GGUF and token ids, greedy",
        "model": os.path.basename(model),
        "machine": machine(),
        "date": date,
        "command": "python benchmarks/bench_cpu_peer.py " + shlex.join(sys.argv[1:]),
        "loadavg_at_start": started, "loadavg_at_end": loadavg(),
        "note": args.note,
        "prompts": {"chat_tokens": len(ids["chat"]), "grounded_tokens": len(ids["grounded"]),
                    "pp_tokens": len(ids["long"])},
        "rows": rows,
        "runs": {k: [{kk: vv for kk, vv in r.items() if not kk.endswith("_tokens")} for r in v] for k, v in runs.items()},
    }
    print(json.dumps(rows, indent=1))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out, ROOT)}", file=sys.stderr)


def _medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in results[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {k: round(statistics.median(r[k] for r in results), 3) for k in keys}


if __name__ == "__main__":
    main()
