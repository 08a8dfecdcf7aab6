#!/bin/bash
# Issue 48 figures, events released / events produced, for file sources: a renamed file read
# from a new state dir (A), renamed under --accept-change (B), a state dir restored from an older
# backup to another path (C) or in place with its release-dir anchor deleted (D; C and D then
# follow the publication clash's advice: a new release.dir), a grown file read from a new state
# dir (E). Each case has its own budget registry ($XDG_STATE_HOME).
# usage: bench/service/lineage_figures.sh TREE   (PY: the python with panagg's dependencies)
TREE=$1; W=$(mktemp -d); cd $W
export PYTHONPATH=$TREE XDG_STATE_HOME=$W/xdg
PY=${PY:-python}
gen() { $PY -c "import json,sys,random; r=random.Random(int(sys.argv[2])); open(sys.argv[1],'a').write(''.join(json.dumps({'item': r.randrange(10)})+'\n' for _ in range(int(sys.argv[3]))))" "$@"; }
run() { f=$1; st=$2; rel=$3; shift 3
  $PY -m aggregator.service.cli run --set source.kind=file --set source.format=json --set source.path=$f \
   --set state.domain_size=10 --set window.kind=count --set window.size=100 --set checkpoint.dir=$st \
   --set release.dir=$rel --set metrics.port=-1 --set release.plan_errors=false \
   --set release.on_exhausted=false "$@" >>log 2>&1; }
released() { cat "$@" 2>/dev/null | $PY -c "import sys,json; print(sum(json.loads(l)['n'] for l in sys.stdin if l.strip()))"; }
rel() { for d in "$@"; do for f in $d/release-*.json; do [ -f $f ] && $PY -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" $f; done; done | released; }
# A: renamed file, new state dir
mkdir A && cd A && export XDG_STATE_HOME=$W/A/xdg && gen e.jsonl 1 300 && run e.jsonl s1 r1 && mv e.jsonl renamed.jsonl && run renamed.jsonl s2 r2
echo "A renamed file, new state dir: $(rel r1 r2) / 300"; cd ..
# B: renamed file, --accept-change on source.path, same state dir
mkdir B && cd B && export XDG_STATE_HOME=$W/B/xdg && gen e.jsonl 1 300 && run e.jsonl s1 r1 && mv e.jsonl renamed.jsonl && run renamed.jsonl s1 r1 --accept-change
echo "B renamed file, --accept-change: $(rel r1) / 300"; cd ..
# C: state dir restored (older backup) to another path
mkdir C && cd C && export XDG_STATE_HOME=$W/C/xdg && gen e.jsonl 1 200 && run e.jsonl s1 r1 && cp -r s1 backup && gen e.jsonl 2 200 && run e.jsonl s1 r1 && cp -r backup s2 && run e.jsonl s2 r1; run e.jsonl s2 r1b --accept-change
echo "C state dir restored to another path (then a new release.dir, as the clash advises): $(rel r1 r1b) / 400"; cd ..
# D: older backup restored in place, anchor dotfile deleted
mkdir D && cd D && export XDG_STATE_HOME=$W/D/xdg && gen e.jsonl 1 200 && run e.jsonl s1 r1 && cp -r s1 backup && gen e.jsonl 2 200 && run e.jsonl s1 r1 && rm -rf s1 && cp -r backup s1 && rm -f r1/.panagg-ledger-head-* && run e.jsonl s1 r1; run e.jsonl s1 r1b --accept-change
echo "D restored in place, anchor deleted (then a new release.dir): $(rel r1 r1b) / 400"; cd ..
# E: a grown file (appended), read by a new state dir
mkdir E && cd E && export XDG_STATE_HOME=$W/E/xdg && gen e.jsonl 1 300 && run e.jsonl s1 r1 && gen e.jsonl 2 100 && run e.jsonl s2 r2
echo "E grown file, new state dir: $(rel r1 r2) / 400"; cd ..
echo "(work dir $W)"
