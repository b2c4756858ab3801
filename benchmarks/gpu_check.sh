#!/usr/bin/env bash
# The bundled model's whole serving path on a GPU (`--device cuda`): generate, the accuracy and
# steps table in float32, bfloat16 and with CUDA graphs, and the HTTP server (CUDA graphs on)
# answering plain and streaming requests, then shutting down gracefully. Prepared for a machine
# with one GPU, run from the repository root without installing (PYTHONPATH); logs go to $OUT
# (default gpu-check/).
#
#     bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-gpu-check}
PORT=${PORT:-8321}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu NUM=50 tries the script on a machine without a GPU
NUM=${NUM:-500}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ds() { python3 -m dilaserve.cli "$@"; }

echo "== generate"
ds generate --device "$DEVICE" --prompt "Tom has 12 apples. Tom buys 5 more. Then Tom gives away 3. How many apples does Tom have now?"

for run in "float32 0" "bfloat16 0" "float32 8"; do
    set -- $run
    echo "== eval, $1, --cuda-graphs $2"
    ds eval --device "$DEVICE" --dtype "$1" --cuda-graphs "$2" --num "$NUM" \
        --thresholds 0.5,0.7,0.9 --out /tmp/gpu-runs
done

echo "== serve"
ds serve --device "$DEVICE" --cuda-graphs 8 --instances 1 --port "$PORT" >"$OUT/serve.log" 2>&1 &
server=$!
python3 - "$PORT" <<'PY'
import json, sys, time
import httpx

base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(120):
    try:
        if httpx.get(f"{base}/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
else:
    sys.exit("server did not come up in 60 s")
model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
question = "Mia has 7 shells. Mia finds 5 more. How many shells?"
plain = {"model": model, "prompt": question, "max_tokens": 64}
r = httpx.post(f"{base}/v1/completions", json=plain, timeout=60)
print("completion", r.status_code, json.dumps(r.json())[:400])
chat = [{"role": "user", "content": question}]
body = {"model": model, "messages": chat, "stream": True, "max_tokens": 64}
with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as s:
    events = [line for line in s.iter_lines() if line.startswith("data:")]
chunks = [json.loads(e[5:]) for e in events if e != "data: [DONE]"]
text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
print("stream", len(events), "events, text:", repr(text), "last:", events[-1] if events else None)
bad = httpx.post(f"{base}/v1/completions", json={**plain, "max_tokens": -1})
print("bad request", bad.status_code, bad.json()["error"]["message"][:120])
metrics = httpx.get(f"{base}/metrics").text.splitlines()
print("\n".join(m for m in metrics if m.startswith("dilaserve_requests")))
PY
kill -TERM "$server"  # graceful: stop accepting, drain, exit (SIGINT is ignored in background)
wait "$server"
echo "server exit status: $? (143: ended by SIGTERM, after draining)"
tail -5 "$OUT/serve.log"
