# Shared by the long queues (results.sh, general.sh): source it, do not run it.
# seed OUT [NAME ...]: before a run writes OUT, copy back the partial run committed to docs/artifacts under
# OUT's own name or, failing that, the first NAME that exists: its results (NAME.jsonl.gz), its timings
# (NAME.timings.jsonl.gz) when committed, and its meta, when the maps its meta records are byte-identical to
# the ones next to OUT (calibration is deterministic). A fresh machine then continues a run instead of
# starting it again. An OUT that exists is left alone.
seed() {
  local out=$1 name; shift
  [ -f "$out" ] && return 0
  for name in "$(basename "${out%.jsonl}")" "$@"; do
    [ -f "docs/artifacts/$name.jsonl.gz" ] && break
  done
  [ -f "docs/artifacts/$name.jsonl.gz" ] || return 0
  python - "$out" "$name" <<'PY'
import gzip, hashlib, json, os, shutil, sys
out, name = sys.argv[1], sys.argv[2]
art = f"docs/artifacts/{name}"
meta = json.load(open(f"{art}.meta.json"))
maps = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(out))), "maps")
for label, m in meta["maps"].items():
    path = os.path.join(maps, os.path.basename(m["file"]))
    try:
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    except FileNotFoundError:
        digest = None
    if digest != m["sha256"]:
        print(f"seed {name}: map {label} ({path}) differs from the committed run's; starting afresh")
        sys.exit(0)
    m["file"] = path
stem = out[: -len(".jsonl")]
for part, dest in ((".jsonl.gz", out), (".timings.jsonl.gz", stem + ".timings.jsonl")):
    if os.path.isfile(art + part):
        with gzip.open(art + part, "rb") as f, open(dest, "wb") as g:
            shutil.copyfileobj(f, g)
json.dump(meta, open(stem + ".meta.json", "w"), indent=1)
print(f"seed {name}: continuing the committed run ({sum(1 for _ in open(out))} records)")
PY
}
# shipped MAP: a map committed to docs/artifacts/maps is copied to MAP when MAP is missing, so a fresh machine
# continues with the very map the committed runs used instead of recalibrating (calibration is deterministic on
# one machine only; scripts/rebase_map.py).
shipped() {
  local art; art=docs/artifacts/maps/$(basename "$1")
  [ -f "$1" ] || [ ! -f "$art" ] || cp "$art" "$1"
}
