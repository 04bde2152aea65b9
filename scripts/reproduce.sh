#!/usr/bin/env bash
# Reproduce README's figures: one step per row of its two results tables, in README's order, each the
# rarecache command that made the committed record it links (docs/artifacts/...). Outputs go under $OUT
# (default: $RARECACHE_HOME/reproduce, else ~/.cache/rarecache/reproduce), never into the checkout.
# Resumable: `eval run` continues a results file where it stopped, and a step that finished leaves
# $OUT/done/STEP, so running the script again skips it (delete that file to run a step again).
#   bash scripts/reproduce.sh --list            # the steps, the figure each makes, its commands
#   bash scripts/reproduce.sh [STEP ...]        # every step, or the ones named
# The evaluation steps take hours each on 2 CPU cores. The vLLM steps need the vllm extra (docs/VLLM.md);
# the GPU row is scripts/gpu.sh on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-${RARECACHE_HOME:-$HOME/.cache/rarecache}/reproduce}
S=qwen2.5-coder-0.5b-instruct; T=qwen2.5-coder-1.5b-instruct
RC=${RARECACHE:-rarecache}  # e.g. RARECACHE="python -m rarecache.cli" where the command is not installed

# The maps, by the name the records carry. SERVED: the map the package ships. V2 (the map served before
# v3; CoQA's record went through it) and REV (1.5B -> 0.5B) are looked up in $OUT/maps, then
# $RARECACHE_HOME/maps, then where a checkout commits them. V2 is no longer in the tree: where none is found, its
# exact bytes come from git history (docs/RESULTS.md, "Maps that are no longer in the tree", also gives the
# commands that make it again). A record's meta names each map's sha256, so a map made again on another
# machine is checked, not assumed.
served_map() {
  "${PYTHON:-python}" -c "from rarecache.defaults import served_map_file; print(served_map_file())" 2>/dev/null \
    || echo rarecache/data/general-v4-64k.safetensors
}
find_map() {  # NAME [COMMIT:PATH]: the first copy found, else the one git history holds, put in $OUT/maps
  local p
  for p in "$OUT/maps/$1" "${RARECACHE_HOME:-$HOME/.cache/rarecache}/maps/$1" "docs/artifacts/maps/$1"; do
    [ -f "$p" ] && { echo "$p"; return; }
  done
  if [ -n "${2:-}" ] && git cat-file -e "$2" 2>/dev/null; then
    git show "$2" > "$OUT/maps/$1.part" && mv "$OUT/maps/$1.part" "$OUT/maps/$1" && { echo "$OUT/maps/$1"; return; }
  fi
  echo "reproduce: no $1 (put it in $OUT/maps: docs/RESULTS.md, 'Maps that are no longer in the tree')" >&2
  return 1
}

STEPS=(acc-mmlu acc-arc_challenge acc-hellaswag acc-coqa_passage acc-gsm8k drift-coqa probe summary reverse
       ceiling longctx bench-handoff bench-serve bench-load bench-vllm-switch bench-vllm-load)
# The results table's steps run v4 (the served map, label v4b in the records) beside v3 (the map it replaced, put
# back from git history) in the same files, as the adoption runs did (research/fidelity/ADOPTION.md).
what() {  # the figure a step makes, and where the committed one is
  case $1 in
    acc-gsm8k) echo "results table, GSM8K exact match (8-shot CoT, items 0-99): target / source / the served arm through" \
                    "v4 and v3 (research/fidelity/adopt/gsm8k; bf16; hours: every arm generates)";;
    acc-*) local t=${1#acc-}
      echo "results table, ${t} (items 0-299): target / source / the handoff arms through v4 and v3 with the served arm and" \
           "suffix 0.3 (served before it), agreement and the delta's CI (research/fidelity/adopt/${t}, research/fidelity/f32head/${t}; bf16)";;
    drift-coqa) echo "results table, CoQA: bpb per target turn, 50 stories switching every turn, no healing, through v4" \
                     "and v3 (research/fidelity/adopt/drift-coqa-v4b-50, research/gate/drift-coqa-v3-50; bf16)";;
    probe) echo "the fidelity probe through v4 and v3 (research/fidelity/adopt/probe; bf16; minutes)";;
    summary) echo "docs/artifacts/fidelity-summary.json from the steps above (their files in \$OUT)";;
    reverse) echo "results table, large -> small MMLU, HellaSwag, ARC-C, passage QA (research/fidelity/runs/reverse-v4tok-*-300;" \
                  "bf16; makes the 64k reverse map first if none is found: 22 minutes when it was made)";;
    ceiling) echo "README's budget line: MMLU agreement through v4's suffix at rho 0.2-0.7, the 1.5B in float32 against" \
                  "bf16, and the suffix handoff's speed at those budgets (research/fidelity/ceiling, research/fidelity/adopt/mmlu," \
                  "research/fidelity/bench/handoff-2048-suffix-v4b*.txt; bf16; about 30 minutes)";;
    longctx) echo "the long-context suite (docs/artifacts/longctx-summary.json): retrieval, multidoc_qa, code_qa, multiturn," \
                  "passage_qa_gen at T 1024 and 2048 (100 items each), retrieval and multidoc_qa at 4096 (30 items): target /" \
                  "source / the served arm through the served map (labelled by its sha256 prefix), then the served handoff" \
                  "timed against the 1.5B's prefill at T 2048; bf16; days on 2 cores: run it in the background, it resumes";;
    bench-handoff) echo "speed table: handoff vs the 1.5B's prefill, batch 1, T 512/2048 (docs/artifacts/bench-handoff-b1-packed.txt;" \
                        "bf16, rank; timed through the served map, of the same shapes as the record's)";;
    bench-serve) echo "speed table: a switched conversation's first token in rarecache serve (docs/artifacts/bench-serve-switch.txt)";;
    bench-load) echo "speed table: continuous batching, 4 clients (docs/artifacts/bench-serve-load.txt)";;
    bench-vllm-switch) echo "speed table: switched conversation inside vLLM (docs/artifacts/bench-vllm-switch.txt; float32;" \
                            "the vllm extra)";;
    bench-vllm-load) echo "speed table: the paper's serving experiment in vLLM, 200 requests (docs/artifacts/bench-vllm-load-200.txt;" \
                          "float32; the vllm extra)";;
  esac
}
cmds() {  # the commands of a step, one per line, as they run (variables expand at run time)
  case $1 in
    acc-*) local t=${1#acc-} arms="target source 0.2:suffix@v3 0.2:suffix@v4b 0.3:suffix@v4b 0.2:rank@v4b 0.3:rank@v4b \$ARM@v4b"
      local more="--limit 300"
      [ "$t" = gsm8k ] && arms="target source 0.2:suffix@v3 0.3:suffix@v4b \$ARM@v4b" more="--limit 100 --batch 10"
      echo "\$RC eval run --task $t --source \$S --target \$T --map v3=\$V3 v4b=\$SERVED --arms $arms $more --dtype bfloat16 --out \$OUT/adopt-$t.jsonl"
      echo "\$RC eval report \$OUT/adopt-$t.jsonl > \$OUT/adopt-$t.report.md";;
    drift-coqa)
      echo "\$RC eval drift run --source \$S --target \$T --map \$SERVED --arms alone 0.2:suffix 0.3:suffix 0.2:rank 0.3:rank --stories 50 --dtype bfloat16 --out \$OUT/drift-coqa-v4b.jsonl"
      echo "\$RC eval drift run --source \$S --target \$T --map \$V3 --arms alone 0.2:suffix --stories 50 --dtype bfloat16 --out \$OUT/drift-coqa-v3.jsonl"
      echo "\$RC eval drift report \$OUT/drift-coqa-v4b.jsonl > \$OUT/drift-coqa-v4b.md";;
    probe)
      echo "\$RC eval probe --source \$S --target \$T --map v3=\$V3 v4b=\$SERVED --arms 0:rank 0.2:suffix 0.3:suffix 0.2:rank 0.3:rank --dtype bfloat16 --out \$OUT/probe.jsonl";;
    summary)
      echo "\$RC eval report \$OUT/adopt-{mmlu,arc_challenge,hellaswag,gsm8k,coqa_passage}.jsonl --drift \$OUT/drift-coqa-v4b.jsonl --previous-drift \$OUT/drift-coqa-v3.jsonl --probe \$OUT/probe.summary.json --arm \$ARM --previous-arm 0.2:suffix --map-label v4b --previous-label v3 --fidelity-summary \$OUT/fidelity-summary.json";;
    reverse)
      echo "REV=\$(find_map general-tok-64k-1.5b-to-0.5b.safetensors 2>/dev/null) || { REV=\$OUT/maps/general-tok-64k-1.5b-to-0.5b.safetensors; \$RC calibrate --source \$T --target \$S --preset general --tokens 65536 --token-inputs --exact-layer0 --dtype bfloat16 --out \$REV; }"
      for t in mmlu hellaswag arc_challenge coqa_passage; do
        echo "\$RC eval run --task $t --source \$T --target \$S --map rv=\$REV --arms target source 0:suffix@rv 0.2:suffix@rv 0.2:rank@rv --limit 300 --dtype bfloat16 --out \$OUT/reverse-$t.jsonl"
        echo "\$RC eval report \$OUT/reverse-$t.jsonl > \$OUT/reverse-$t.report.md"
      done;;
    ceiling)
      echo "\$RC eval run --task mmlu --source \$S --target \$T --map v4=\$SERVED --arms target 0.2:suffix@v4 0.3:suffix@v4 0.5:suffix@v4 0.7:suffix@v4 --limit 300 --dtype bfloat16 --out \$OUT/ceiling-mmlu.jsonl"
      echo "\$RC eval report \$OUT/ceiling-mmlu.jsonl > \$OUT/ceiling-mmlu.report.md"
      echo "\$RC eval run --task mmlu --source \$S --target \$T --map v4=\$SERVED --arms target --limit 300 --dtype float32 --out \$OUT/ceiling-mmlu-fp32.jsonl"
      echo "\${PYTHON:-python} research/scripts/agreement_ceiling.py \$OUT/ceiling-mmlu.jsonl \$OUT/ceiling-mmlu-fp32.jsonl:target:float32 \$OUT/ceiling-mmlu.jsonl:rho=0.2/suffix@v4:suffix-0.2 \$OUT/ceiling-mmlu.jsonl:rho=0.3/suffix@v4:suffix-0.3 \$OUT/ceiling-mmlu.jsonl:rho=0.5/suffix@v4:suffix-0.5 \$OUT/ceiling-mmlu.jsonl:rho=0.7/suffix@v4:suffix-0.7 | tee \$OUT/ceiling-mmlu.md"
      echo "\$RC bench handoff --source \$S --target \$T --map \$SERVED --lengths 2048 --rhos 0.2 0.3 0.5 0.7 --batches 1 --repeats 2 --selector suffix --dtype bfloat16 --out \$OUT/bench-handoff-suffix.json --no-summary | tee \$OUT/bench-handoff-suffix.txt";;
    longctx)
      local files="" tl t L n
      echo "SL=\$(sha256sum \"\$SERVED\" | cut -c1-12)"  # the served map's label: its sha256 prefix
      for tl in {retrieval,multidoc_qa,code_qa,multiturn,passage_qa_gen}@{1024,2048} {retrieval,multidoc_qa}@4096; do
        t=${tl%@*} L=${tl#*@} n=100; [ "$L" = 4096 ] && n=30
        echo "\$RC eval run --task $t --length $L --source \$S --target \$T --map \$SL=\$SERVED --arms target source \$ARM@\$SL --limit $n --dtype bfloat16 --out \$OUT/longctx-$t-$L.jsonl"
        echo "\$RC eval report \$OUT/longctx-$t-$L.jsonl > \$OUT/longctx-$t-$L.report.md"
        files="$files \$OUT/longctx-$t-$L.jsonl"
      done
      echo "\$RC bench handoff --source \$S --target \$T --map \$SERVED --lengths 2048 --rhos \${ARM%%:*} --batches 1 --repeats 5 --selector \${ARM#*:} --dtype bfloat16 --out \$OUT/bench-longctx.json --no-summary | tee \$OUT/bench-longctx.txt"
      echo "\$RC eval longctx-summary$files --bench \$OUT/bench-longctx.json --arm \$ARM --map-label \$SL --out \$OUT/longctx-summary.json";;
    bench-handoff)
      echo "\$RC bench handoff --source \$S --target \$T --map \$SERVED --lengths 512 2048 --rhos 0.2 0.3 0.5 --batches 1 --repeats 5 --selector rank --dtype bfloat16 --out \$OUT/bench-handoff.json --no-summary | tee \$OUT/bench-handoff.txt";;
    bench-serve)
      echo "\$RC bench serve --source \$S --target \$T --map \$SERVED --conversations 3 --passage-tokens 1024 --rho 0.3 --selector rank --dtype bfloat16 --out \$OUT/bench-serve-switch.json | tee \$OUT/bench-serve-switch.txt";;
    bench-load)
      echo "\$RC bench load --dtype bfloat16 --out \$OUT/bench-serve-load.json | tee \$OUT/bench-serve-load.txt";;
    bench-vllm-switch)
      echo "\$RC bench serve --engine vllm --source \$S --target \$T --map \$SERVED --dtype float32 --lengths 512 2048 --rhos 0.1 0.3 --repeats 3 --selector rank --out \$OUT/bench-vllm-switch.json --no-summary | tee \$OUT/bench-vllm-switch.txt";;
    bench-vllm-load)
      echo "\$RC bench load --engine vllm --source \$S --target \$T --map \$SERVED --dtype float32 --loads 0.98 --requests 200 --discard 20 --selector rank --out \$OUT/bench-vllm-load.json --no-summary | tee \$OUT/bench-vllm-load.txt";;
  esac
}

if [ "${1:-}" = --list ]; then
  echo "OUT=$OUT  S=$S  T=$T  SERVED=the shipped map (rarecache.defaults)"
  for s in "${STEPS[@]}"; do
    printf '\n%s: %s\n' "$s" "$(what "$s")"
    cmds "$s" | sed 's/^/    /'
  done
  printf '\ngpu: speed table, H200 row (docs/artifacts/gpu-h200/): OUT=DIR bash scripts/gpu.sh on a GPU machine\n'
  exit 0
fi
chosen=("$@"); [ ${#chosen[@]} -gt 0 ] || chosen=("${STEPS[@]}")
for s in "${chosen[@]}"; do
  [ -n "$(what "$s")" ] || { echo "reproduce: no step $s (--list names them)" >&2; exit 2; }
done
mkdir -p "$OUT/done" "$OUT/maps"
SERVED=$(served_map)
ARM=$("${PYTHON:-python}" -c "from rarecache.defaults import SERVED as s; print(f'{s.rho:g}:{s.selector}')")  # the served arm
V3=""; if printf '%s\n' "${chosen[@]}" | grep -qE '^(acc-|drift-coqa|probe)'; then
  V3=$(find_map general-v3-64k.safetensors 76deea5:rarecache/data/general-v3-64k.safetensors); fi
for s in "${chosen[@]}"; do
  if [ -f "$OUT/done/$s" ]; then echo "== $s: done ($OUT/done/$s)"; continue; fi
  echo "== $s: $(what "$s")"
  mapfile -t lines < <(cmds "$s")  # (read first: a command reading stdin must not eat the list)
  for c in "${lines[@]}"; do
    echo "+ $c"
    eval "$c" < /dev/null
  done
  date -u +%FT%TZ > "$OUT/done/$s"
done
