# Shared by the long queues (results.sh, general.sh): source it, do not run it.
# seed OUT: before a run writes OUT (RUNS/eval/NAME.jsonl), copy back the partial run committed to docs/artifacts
# as NAME or NAME-<n items> (research/scripts/publish.sh; the one with the most records): its results, its timings when
# committed, and its meta, when the maps its meta records are byte-identical to the ones in RUNS/maps (a
# calibration is deterministic on one machine; `shipped` puts the committed maps there). A fresh machine then
# continues a run instead of starting it again. An OUT that exists is left alone.
seed() {
  [ -f "$1" ] || python - "$1" <<'PY'
import gzip, hashlib, json, os, re, shutil, sys
out = sys.argv[1]
name, stem = os.path.basename(out)[: -len(".jsonl")], out[: -len(".jsonl")]
maps = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(out))), "maps")
digests = {}
def ok(art):  # the committed run's maps are the ones here
    meta = json.load(open(f"docs/artifacts/{art}.meta.json"))
    for label, m in meta["maps"].items():
        path = os.path.join(maps, os.path.basename(m["file"]))
        if path not in digests:
            digests[path] = hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.isfile(path) else None
        if digests[path] != m["sha256"]:
            print(f"seed {name}: map {label} ({path}) differs from {art}'s; not continuing it")
            return None
        m["file"] = path
    return meta
arts = [f[: -len(".jsonl.gz")] for f in sorted(os.listdir("docs/artifacts"))
        if re.fullmatch(re.escape(name) + r"(-\d+)?\.jsonl\.gz", f)]
arts.sort(key=lambda a: -sum(1 for _ in gzip.open(f"docs/artifacts/{a}.jsonl.gz")))
for art in arts:
    meta = ok(art)
    if meta is None:
        continue
    base = f"docs/artifacts/{art}"
    for part, dest in ((".jsonl.gz", out), (".timings.jsonl.gz", stem + ".timings.jsonl")):
        if os.path.isfile(base + part):
            with gzip.open(base + part, "rb") as f, open(dest, "wb") as g:
                shutil.copyfileobj(f, g)
    json.dump(meta, open(stem + ".meta.json", "w"), indent=1)
    print(f"seed {name}: continuing the committed run {art} ({sum(1 for _ in open(out))} records)")
    break
PY
}
# shipped MAP: a map committed to docs/artifacts/maps, else one put back in $REBUILT, is copied to MAP when MAP is
# missing, so a fresh machine continues with the very map the committed runs used instead of recalibrating
# (calibration is deterministic on one machine only; research/scripts/rebase_map.py). REBUILT ($REBUILT_MAPS,
# default $RARECACHE_HOME/maps) holds the maps no longer in the tree (v2's general-64k.safetensors and
# general-64k-0.5b-to-1.5b.safetensors): docs/RESULTS.md, "Maps that are no longer in the tree", gives the
# `git show` that puts back their exact bytes and the commands that make them again.
REBUILT=${REBUILT_MAPS:-${RARECACHE_HOME:-$HOME/.cache/rarecache}/maps}
shipped() {
  local art; art=docs/artifacts/maps/$(basename "$1")
  [ -f "$art" ] || art=$REBUILT/$(basename "$1")
  [ -f "$1" ] || [ ! -f "$art" ] || cp "$art" "$1"
}
# gate_side_fits ARM HELD EVAL OUT POLICIES: beside the joint policy, each task's own (fitted on its held items
# alone: what a deployment fitting the gate on its own traffic gets, research/LOG.md 9) and the fit bounding the accuracy
# lost instead of changed answers, each reported on the evaluated items. HELD holds ridge-held-TASK.jsonl and EVAL
# ridge-TASK.jsonl for every task of $TASKS; the reports go to OUT (gate-report-per-task.md,
# gate-report-accuracy.md), the policies and the accuracy fit's summary to POLICIES. Its steps are chained, so a
# caller may run it as `gate_side_fits ... || echo` (where errexit is off).
gate_side_fits() {
  local arm=$1 held=$2 ev=$3 out=$4 pol=$5 t hs=() es=()
  : > "$out/gate-report-per-task.md"
  for t in "${TASKS[@]}"; do
    hs+=("$held/ridge-held-$t.jsonl"); es+=("$ev/ridge-$t.jsonl")
    { rarecache eval gate fit "$held/ridge-held-$t.jsonl" --arm "$arm" --out "$pol/gate-policy-$t.json" &&
      rarecache eval gate report "$ev/ridge-$t.jsonl" --arm "$arm" --policy "$pol/gate-policy-$t.json" && echo
    } >> "$out/gate-report-per-task.md" || { echo "PER-TASK GATE FAILED for $t"; return 1; }
  done
  rm -f "$pol/gate-policy-accuracy.json" "$pol/gate-summary-accuracy.json"
  rarecache eval gate fit "${hs[@]}" --arm "$arm" --loss accuracy --out "$pol/gate-policy-accuracy.json" \
      > "$out/gate-report-accuracy.md" &&
  rarecache eval gate report "${es[@]}" --arm "$arm" --policy "$pol/gate-policy-accuracy.json" \
      --summary "$pol/gate-summary-accuracy.json" >> "$out/gate-report-accuracy.md"
}
# v3_map: the path of v3, the general map served until v4 (issue #41), put back in $REBUILT from git history
# (its exact bytes; docs/RESULTS.md, "Maps that are no longer in the tree") when it is not there yet.
V3_FROM=76deea5:rarecache/data/general-v3-64k.safetensors
v3_map() {
  local f=$REBUILT/general-v3-64k.safetensors
  if [ ! -f "$f" ]; then mkdir -p "$REBUILT" && git show "$V3_FROM" > "$f.part" && mv "$f.part" "$f"; fi
  echo "$f"
}
# seed_as E NAME DIR FILE: before a run writes E/NAME.jsonl (E under RUNS), start it from DIR's committed FILE
# (FILE.jsonl.gz, its timings when committed, its meta with the RUNS/ paths pointed back at this machine's RUNS).
# An E/NAME.jsonl that exists is left alone.
seed_as() {
  local e=$1 name=$2 d=$3 f=$4 runs; runs=$(dirname "$e")
  [ ! -f "$e/$name.jsonl" ] || return 0
  gzip -dc "$d/$f.jsonl.gz" > "$e/$name.jsonl"
  sed "s|RUNS/|$runs/|g" "$d/$f.meta.json" > "$e/$name.meta.json"
  [ ! -f "$d/$f.timings.jsonl.gz" ] || gzip -dc "$d/$f.timings.jsonl.gz" > "$e/$name.timings.jsonl"
}
# seed_from E NAME DIR...: seed_as from the first DIR holding NAME.jsonl.gz (a session's rows committed under
# research/fidelity/..., else the base records a candidate's runs are added to); a NAME no DIR holds is left alone.
seed_from() {
  local e=$1 name=$2 d; shift 2
  for d in "$@"; do
    if [ -f "$d/$name.jsonl.gz" ]; then seed_as "$e" "$name" "$d" "$name"; return 0; fi
  done
}
