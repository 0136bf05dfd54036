#!/usr/bin/env bash
# bench/device/pack.sh KIT [--update] [--quiet]: make the GPU check's kit, a git-ignored folder of at most 60 MiB
# (what it holds: bench/device/kit.py; --update keeps the parts of an existing kit that did not change).
# Python: $PYTHON, else the repository's .venv, else python3 (it needs the project's packages).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${PYTHON:-}
if [[ -z $py ]]; then
    if [[ -x $root/.venv/bin/python ]]; then py=$root/.venv/bin/python; else py=python3; fi
fi
cd "$root"
exec "$py" "$here/kit.py" pack "$@"
