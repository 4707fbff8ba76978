#!/usr/bin/env bash
# The tests a change adds and removes: every test id pytest collects at REV (default HEAD)
# against the working tree, with their counts. A change that
# makes the suite faster must not make it smaller (tests/README.md, "Keeping it honest").
#
# Usage: scripts/test_ids.sh [REV] [VENV]     (`make test-ids REV=...`)
# Prints the removed ids (-), the added ones (+), then one line of counts; exits 1 when any id
# was removed, so a merge of tests is a stated decision, never an accident.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
venv=${2:-.venv}
python=$(cd "$venv" 2>/dev/null && pwd)/bin/python
[[ -x $python ]] || { echo "test_ids: no python at $python (make setup first)" >&2; exit 2; }
git rev-parse --verify -q "$rev^{commit}" >/dev/null || {
    echo "test_ids: no commit $rev" >&2; exit 2; }

work=$(mktemp -d)
trap 'git worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

collect() {  # directory -> sorted test ids
    (cd "$1" && "$python" -m pytest --collect-only -q -p no:cacheprovider tests \
        2>/dev/null | grep '::' | sort) || true
}

git worktree add -q --detach "$work/tree" "$rev"
collect "$work/tree" >"$work/before"
collect . >"$work/after"
[[ -s $work/before && -s $work/after ]] || { echo "test_ids: collection failed" >&2; exit 2; }

comm -23 "$work/before" "$work/after" | sed 's/^/- /'
comm -13 "$work/before" "$work/after" | sed 's/^/+ /'
removed=$(comm -23 "$work/before" "$work/after" | wc -l)
added=$(comm -13 "$work/before" "$work/after" | wc -l)
echo "test ids: $(wc -l <"$work/before") at $rev, $(wc -l <"$work/after") now" \
     "($added added, $removed removed)"
[[ $removed -eq 0 ]]
