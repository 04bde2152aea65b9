#!/usr/bin/env bash
# Every long CPU run behind docs/RESULTS.md, in priority order. Idempotent and resumable: a map that exists is
# kept, a calibration resumes from its .state, an evaluation resumes from its results file. Run it in the
# background and rerun it after an interruption:
#   nohup bash scripts/results.sh >> runs/logs/results.log 2>&1 &
# (on 2 CPU cores the whole list takes about 12 hours; progress bars go to the log).
set -euxo pipefail
cd "$(dirname "$0")/.."
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
M=runs/maps; E=runs/eval
mkdir -p $M $E
cal() {  # source target "data option" out [extra options]
  [ -f "$4" ] || rarecache calibrate --source "$1" --target "$2" $3 --tokens "${5:-32768}" \
      --heldout-tokens "${6:-4096}" ${7:-} --out "$4"
}
GRID=(--rhos 0 0.2 0.3 0.5 --selectors random attn-source attn-target l2-oracle layer-prefix --dtype bfloat16)
ev() {  # source target task items out maps...
  local s=$1 t=$2 task=$3 n=$4 out=$5; shift 5
  rarecache eval run --task "$task" --source "$s" --target "$t" --map "$@" "${GRID[@]}" --limit "$n" --out "$out" >/dev/null
}
# maps, small -> large
cal $S $T "--corpus wiki" $M/wiki-0.5b-to-1.5b.safetensors 65536 8192
cal $S $T "--task gsm8k" $M/gsm8k-0.5b-to-1.5b.safetensors 65536 8192 "--seq-len 1024"
for task in arc_challenge hellaswag mmlu; do cal $S $T "--task $task" $M/$task-0.5b-to-1.5b.safetensors; done
# evaluations (task-calibrated and generic map in one run: prefills shared)
ev $S $T mmlu 300 $E/mmlu-300.jsonl task=$M/mmlu-0.5b-to-1.5b.safetensors wiki=$M/wiki-0.5b-to-1.5b.safetensors
rarecache eval run --task gsm8k --source $S --target $T --map $M/gsm8k-0.5b-to-1.5b.safetensors --limit 50 \
    --batch 10 --dtype bfloat16 --out $E/gsm8k-50.jsonl >/dev/null
# large -> small
cal $T $S "--corpus wiki" $M/wiki-1.5b-to-0.5b.safetensors
cal $T $S "--task mmlu" $M/mmlu-1.5b-to-0.5b.safetensors
ev $T $S mmlu 300 $E/mmlu-300-reverse.jsonl task=$M/mmlu-1.5b-to-0.5b.safetensors wiki=$M/wiki-1.5b-to-0.5b.safetensors
ev $S $T arc_challenge 300 $E/arc_challenge-300.jsonl task=$M/arc_challenge-0.5b-to-1.5b.safetensors \
    wiki=$M/wiki-0.5b-to-1.5b.safetensors
cal $T $S "--task arc_challenge" $M/arc_challenge-1.5b-to-0.5b.safetensors
ev $T $S arc_challenge 300 $E/arc_challenge-300-reverse.jsonl task=$M/arc_challenge-1.5b-to-0.5b.safetensors \
    wiki=$M/wiki-1.5b-to-0.5b.safetensors
ev $S $T gsm8k_bpb 300 $E/gsm8k_bpb-300.jsonl task=$M/gsm8k-0.5b-to-1.5b.safetensors wiki=$M/wiki-0.5b-to-1.5b.safetensors
ev $S $T hellaswag 300 $E/hellaswag-300.jsonl task=$M/hellaswag-0.5b-to-1.5b.safetensors \
    wiki=$M/wiki-0.5b-to-1.5b.safetensors
# multi-turn and perplexity (smaller samples)
cal $S $T "--task coqa" $M/coqa-0.5b-to-1.5b.safetensors 32768 4096 "--seq-len 2048"
ev $S $T coqa_bpb 200 $E/coqa_bpb-200.jsonl task=$M/coqa-0.5b-to-1.5b.safetensors wiki=$M/wiki-0.5b-to-1.5b.safetensors
ev $S $T wiki_ppl 40 $E/wiki_ppl-40.jsonl wiki=$M/wiki-0.5b-to-1.5b.safetensors
# tables and plots
for f in $E/*.jsonl; do
  case $f in *.timings.jsonl) continue;; esac
  rarecache eval report "$f" --plots docs/artifacts > "${f%.jsonl}.report.md"
  rarecache eval report "$f" --compact > "${f%.jsonl}.compact.md"
done
echo RESULTS DONE
